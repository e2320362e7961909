-- Repo sync (issue 36). A snapshot's events (`#resync`, then one `#record` per record)
-- have no place in the relay's numbering: they are stored with seq NULL, in the order
-- of `received_at` within the snapshot's transaction.
ALTER TABLE firekeeper_events ALTER COLUMN seq DROP NOT NULL;
-- The records mirror (`FIREKEEPER_POSTGRES_RECORDS=true`): every repo's records as its
-- verified state. Live creates and updates upsert, deletes delete, a snapshot replaces
-- the repo's rows; each in the same transaction as the cursor write it goes with. A
-- record Postgres cannot keep as jsonb (a NUL character) is kept in `record_text`.
CREATE TABLE IF NOT EXISTS firekeeper_records (
    did         text        NOT NULL,
    collection  text        NOT NULL,
    rkey        text        NOT NULL,
    cid         text        NOT NULL,
    rev         text        NOT NULL,   -- the commit (or snapshot) that wrote it
    record      jsonb,
    record_text text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (did, collection, rkey)
);
