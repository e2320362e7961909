-- The shared repo-sync queue (repo sync across replicas), when Postgres is the cursor
-- store: one row per repo, the job that counts. The leader publishes (fenced by
-- firekeeper_fence like a cursor commit); workers claim with FOR UPDATE SKIP LOCKED, each
-- claim raising the epoch; only the newest claim may apply or finish the job.
CREATE TABLE IF NOT EXISTS firekeeper_jobs (
    did         text        PRIMARY KEY,
    id          text        NOT NULL,
    epoch       bigint      NOT NULL DEFAULT 0,
    state       text        NOT NULL,          -- queued, claimed, applying, done
    token       bigint      NOT NULL CHECK (token >= 0),
    holder      text        NOT NULL,
    min_rev     text        NOT NULL DEFAULT '',
    reason      text        NOT NULL,
    relay       text        NOT NULL DEFAULT '',
    result      text,
    worker      text,
    touched_at  timestamptz,
    queued_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS firekeeper_jobs_open ON firekeeper_jobs (queued_at) WHERE state <> 'done';
