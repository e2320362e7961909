-- Repos that need repair (desynchronised: a commit failed verification or its chain
-- broke), one row per repo, written only by the current lease holder (fenced by
-- firekeeper_fence like a cursor commit), so a new leader continues what the last knew.
CREATE TABLE IF NOT EXISTS firekeeper_repos (
    did         text        PRIMARY KEY,
    state       text        NOT NULL,          -- the consumer's JSON
    token       bigint      NOT NULL CHECK (token >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
