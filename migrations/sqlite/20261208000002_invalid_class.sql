-- A dead letter laneway set aside because it could not read the op (a
-- value written before the producer contract, or by a hand edit past every
-- check) has an attempt class of its own, `invalid`: it was never tried,
-- and an operator grouping dead letters by class (`dead_letter_groups`,
-- the console) sees it as such instead of as a class-less row. The ops the
-- earlier migrations set aside get their `invalid` attempt row here.
--
-- SQLite cannot alter a CHECK: the table is rebuilt with every row (no
-- trigger or view names it, so the rename below rewrites nothing).
CREATE TABLE laneway_attempts_rebuilt (
    op_id       INTEGER NOT NULL REFERENCES laneway_ops (id),
    attempt     INTEGER NOT NULL CHECK (attempt >= 1),
    started_at  INTEGER NOT NULL,
    finished_at INTEGER NOT NULL,
    outcome     TEXT    NOT NULL
                CHECK (outcome IN ('confirmed', 'retryable', 'permanent', 'plugin_fault', 'lease_expired', 'invalid')),
    detail      TEXT,
    fee         INTEGER,
    error       TEXT,
    PRIMARY KEY (op_id, attempt)
);
INSERT INTO laneway_attempts_rebuilt (op_id, attempt, started_at, finished_at, outcome, detail, fee, error)
SELECT op_id, attempt, started_at, finished_at, outcome, detail, fee, error FROM laneway_attempts;
DROP TABLE laneway_attempts;
ALTER TABLE laneway_attempts_rebuilt RENAME TO laneway_attempts;

-- The row is the op's last attempt (attempts + 1), which is where an
-- operator's view of a dead letter looks for its class.
INSERT INTO laneway_attempts (op_id, attempt, started_at, finished_at, outcome, error)
SELECT o.id, o.attempts + 1, COALESCE(o.finished_at, o.updated_at), COALESCE(o.finished_at, o.updated_at), 'invalid',
    o.last_error
FROM laneway_ops o
WHERE o.status = 'failed'
  AND (o.last_error LIKE 'invalid: a time laneway cannot read:%'
       OR o.last_error LIKE 'invalid: a value laneway cannot read:%'
       OR o.last_error LIKE 'invalid: written before the producer contract%');
UPDATE laneway_ops SET attempts = attempts + 1
WHERE id IN (SELECT op_id FROM laneway_attempts WHERE outcome = 'invalid');
