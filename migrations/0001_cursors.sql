-- Relay cursors, one row per relay fingerprint, written only by the current lease holder.
CREATE TABLE IF NOT EXISTS firekeeper_cursors (
    relay       text        PRIMARY KEY,                 -- sha256 hex relay fingerprint
    cursor      bigint      NOT NULL CHECK (cursor >= 0 AND cursor <= 9007199254740991),
    token       bigint      NOT NULL CHECK (token >= 0), -- fencing token of the last writer
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The highest fencing token any writer has presented. A commit with a lower token is
-- refused: that writer's lease has been superseded.
CREATE TABLE IF NOT EXISTS firekeeper_fence (
    id     boolean PRIMARY KEY DEFAULT true CHECK (id),
    token  bigint  NOT NULL CHECK (token >= 0)
);
