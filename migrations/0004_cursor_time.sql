-- The relay time (Unix ms) of the event at each stored cursor, and the relay the last
-- committing leader was on: what relay switches and successors resume by. Cursors
-- stored before this migration keep their seq and get no time (NULL), as a commit
-- without a time leaves it.
ALTER TABLE firekeeper_cursors ADD COLUMN IF NOT EXISTS time_ms bigint;

CREATE TABLE IF NOT EXISTS firekeeper_active_relay (
    id          boolean     PRIMARY KEY DEFAULT true CHECK (id),
    relay       text        NOT NULL,   -- relay fingerprint
    token       bigint      NOT NULL,   -- fencing token of the last writer
    updated_at  timestamptz NOT NULL DEFAULT now()
);
