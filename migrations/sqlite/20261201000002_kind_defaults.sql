-- A producer that inserts with plain SQL and leaves `priority` out gets its
-- kind's configured default priority (a withdrawal is critical), not normal
-- for every kind. laneway writes each kind's default into kind_defaults at
-- `laneway migrate`, at start and at every reload; a kind it does not know
-- is normal.
--
-- SQLite cannot change a column's default in place, so `ops` is rebuilt
-- (SQLite's documented twelve-step procedure; laneway runs its migrations
-- with foreign-key enforcement off and checks the keys afterwards). Every
-- row, id and sequence is kept.

CREATE TABLE kind_defaults (
    kind     TEXT    PRIMARY KEY,
    priority INTEGER NOT NULL CHECK (priority IN (0, 1, 2))
);

CREATE TABLE ops_rebuilt (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    outbox          TEXT    NOT NULL CHECK (length(outbox) > 0),
    kind            TEXT    NOT NULL CHECK (length(kind) > 0),
    -- 0 = critical, 1 = normal, 2 = low; left out (NULL), the kind's
    -- default, filled by ops_default_priority below.
    priority        INTEGER CHECK (priority IN (0, 1, 2)),
    lanes           TEXT    NOT NULL DEFAULT '[]'
                    CHECK (json_valid(lanes) AND json_type(lanes) = 'array'),
    payload         TEXT    NOT NULL CHECK (json_valid(payload)),
    idempotency_key TEXT,
    coalesce_key    TEXT,
    subject         TEXT,
    correlation_id  TEXT,
    status          TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'submitted', 'confirmed', 'failed', 'cancelled')),
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    attempt_floor   INTEGER NOT NULL DEFAULT 0 CHECK (attempt_floor >= 0),
    fee_bumps       INTEGER NOT NULL DEFAULT 0 CHECK (fee_bumps >= 0),
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    lease_owner     TEXT,
    lease_token     TEXT,
    lease_until     INTEGER,
    receipt         TEXT,
    last_error      TEXT,
    created_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    updated_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    finished_at     INTEGER,
    CHECK ((status = 'submitted') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
);

INSERT INTO ops_rebuilt (id, outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject,
    correlation_id, status, attempts, attempt_floor, fee_bumps, next_attempt_at, lease_owner, lease_token,
    lease_until, receipt, last_error, created_at, updated_at, finished_at)
SELECT id, outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject,
    correlation_id, status, attempts, attempt_floor, fee_bumps, next_attempt_at, lease_owner, lease_token,
    lease_until, receipt, last_error, created_at, updated_at, finished_at
FROM ops;

-- Keep the id sequence where it was (AUTOINCREMENT never reuses an id).
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'ops_rebuilt', seq FROM sqlite_sequence WHERE name = 'ops'
    AND NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'ops_rebuilt');
UPDATE sqlite_sequence SET seq = max(seq, (SELECT seq FROM sqlite_sequence WHERE name = 'ops'))
    WHERE name = 'ops_rebuilt' AND EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'ops');

DROP TABLE ops;
ALTER TABLE ops_rebuilt RENAME TO ops;

CREATE UNIQUE INDEX ops_idempotency ON ops (outbox, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE UNIQUE INDEX ops_coalesce ON ops (outbox, coalesce_key)
    WHERE coalesce_key IS NOT NULL AND status IN ('pending', 'submitted');
CREATE INDEX ops_claim ON ops (priority, id) WHERE status = 'pending';
CREATE INDEX ops_outbox_claim ON ops (outbox, priority, id) WHERE status = 'pending';
CREATE INDEX ops_lease ON ops (lease_until) WHERE status = 'submitted';
CREATE INDEX ops_status ON ops (status, id);
CREATE INDEX ops_subject ON ops (subject, id) WHERE subject IS NOT NULL;
CREATE INDEX ops_outbox_active ON ops (outbox, priority, id) WHERE status IN ('pending', 'submitted');
CREATE INDEX ops_due ON ops (next_attempt_at, outbox) WHERE status = 'pending';
CREATE INDEX ops_occupying ON ops (id)
    WHERE status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL);

CREATE TRIGGER ops_fill_lanes AFTER INSERT ON ops
BEGIN
    INSERT OR IGNORE INTO op_lanes (lane, op_id)
        SELECT value, NEW.id FROM json_each(NEW.lanes);
END;

CREATE TRIGGER ops_default_priority AFTER INSERT ON ops
WHEN NEW.priority IS NULL
BEGIN
    UPDATE ops SET priority = COALESCE((SELECT priority FROM kind_defaults WHERE kind = NEW.kind), 1)
        WHERE id = NEW.id;
END;

-- What an op is, and whom it is for, never changes after enqueue.
CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON ops
WHEN NEW.outbox IS NOT OLD.outbox OR NEW.kind IS NOT OLD.kind OR NEW.lanes IS NOT OLD.lanes
  OR NEW.payload IS NOT OLD.payload OR NEW.idempotency_key IS NOT OLD.idempotency_key
  OR NEW.created_at IS NOT OLD.created_at
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable');
END;

-- Nothing may set priority back to NULL afterwards.
CREATE TRIGGER ops_priority_set BEFORE UPDATE OF priority ON ops
WHEN NEW.priority IS NULL
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s priority must be 0, 1 or 2');
END;
