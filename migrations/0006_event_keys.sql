-- Rows are named by the event, not only by its seq: a relay that restarted its numbering
-- (or lost data and grew past the cursor again) serves new events under seqs already
-- stored, and those must be stored too, while a replay of the same event (same key) is
-- not. `event_key` is the sinks' event key (16 hex digits: the repo and rev of a
-- #commit/#sync, the DID and time of an #identity/#account); rows written before this
-- migration have ''. A record Postgres cannot keep as jsonb (a NUL character, which
-- atproto JSON allows) is kept as the JSON text in `body_text` with `body` NULL.
ALTER TABLE firekeeper_events ADD COLUMN IF NOT EXISTS event_key text NOT NULL DEFAULT '';
ALTER TABLE firekeeper_events ADD COLUMN IF NOT EXISTS body_text text;
ALTER TABLE firekeeper_events ALTER COLUMN body DROP NOT NULL;
ALTER TABLE firekeeper_events DROP CONSTRAINT IF EXISTS firekeeper_events_pkey;
CREATE UNIQUE INDEX IF NOT EXISTS firekeeper_events_event ON firekeeper_events (relay, seq, event_key);
ALTER TABLE firekeeper_chain_breaks ADD COLUMN IF NOT EXISTS event_key text NOT NULL DEFAULT '';
ALTER TABLE firekeeper_chain_breaks DROP CONSTRAINT IF EXISTS firekeeper_chain_breaks_pkey;
CREATE UNIQUE INDEX IF NOT EXISTS firekeeper_chain_breaks_event ON firekeeper_chain_breaks (relay, seq, event_key);
