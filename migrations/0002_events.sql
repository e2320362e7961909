-- Events written by the postgres sink. (relay, seq) is unique, so a replay after a crash
-- inserts nothing twice.
CREATE TABLE IF NOT EXISTS firekeeper_events (
    relay       text        NOT NULL,   -- relay fingerprint
    seq         bigint      NOT NULL,
    token       bigint      NOT NULL,   -- fencing token of the term that wrote it
    kind        text        NOT NULL,   -- #commit, #identity, #account, #sync
    did         text,
    body        jsonb       NOT NULL,   -- the event in the atproto JSON data model
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (relay, seq)
);
