-- Repo chain breaks seen by the postgres sink (FIREKEEPER_CHAIN_BREAKS=emit): the relay
-- skipped at least one commit of `did` between `last_rev` and `since`; resync that repo.
-- `seq` is that of the commit that revealed the break (its row is in firekeeper_events).
CREATE TABLE IF NOT EXISTS firekeeper_chain_breaks (
    relay       text        NOT NULL,   -- relay fingerprint
    seq         bigint      NOT NULL,
    token       bigint      NOT NULL,   -- fencing token of the term that wrote it
    did         text        NOT NULL,
    last_rev    text        NOT NULL,   -- the last rev seen for the repo
    since       text        NOT NULL,   -- the rev the commit builds on
    rev         text        NOT NULL,   -- the commit's rev
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (relay, seq)
);
