-- laneway schema v1 (SQLite). Timestamps are Unix milliseconds (INTEGER).
-- The SQL contract for producers is in README.md ("Enqueueing with plain SQL").

CREATE TABLE ops (
    -- Id and global enqueue sequence: dispatch order is (priority, id).
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    outbox          TEXT    NOT NULL CHECK (length(outbox) > 0),
    kind            TEXT    NOT NULL CHECK (length(kind) > 0),
    -- 0 = critical, 1 = normal, 2 = low.
    priority        INTEGER NOT NULL DEFAULT 1 CHECK (priority IN (0, 1, 2)),
    -- A JSON array of lane names; op_lanes is filled from it by a trigger.
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
    -- A submitted op always carries its lease; no other status does.
    CHECK ((status = 'submitted') = (lease_token IS NOT NULL AND lease_until IS NOT NULL))
);

-- Idempotency keys never expire: unique per outbox for the life of the row.
CREATE UNIQUE INDEX ops_idempotency ON ops (outbox, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- A coalesce key is unique only among the outbox's non-terminal ops.
CREATE UNIQUE INDEX ops_coalesce ON ops (outbox, coalesce_key)
    WHERE coalesce_key IS NOT NULL AND status IN ('pending', 'submitted');
-- Claim order, globally and per outbox.
CREATE INDEX ops_claim ON ops (priority, id) WHERE status = 'pending';
CREATE INDEX ops_outbox_claim ON ops (outbox, priority, id) WHERE status = 'pending';
-- Lease expiry scan.
CREATE INDEX ops_lease ON ops (lease_until) WHERE status = 'submitted';
-- Operator listings.
CREATE INDEX ops_status ON ops (status, id);
CREATE INDEX ops_subject ON ops (subject, id) WHERE subject IS NOT NULL;

-- One row per (lane, op), so the scheduler can find each lane's head.
CREATE TABLE op_lanes (
    lane  TEXT    NOT NULL,
    op_id INTEGER NOT NULL REFERENCES ops (id),
    PRIMARY KEY (lane, op_id)
) WITHOUT ROWID;
CREATE INDEX op_lanes_op ON op_lanes (op_id);

CREATE TRIGGER ops_fill_lanes AFTER INSERT ON ops
BEGIN
    INSERT OR IGNORE INTO op_lanes (lane, op_id)
        SELECT value, NEW.id FROM json_each(NEW.lanes);
END;

-- What an op is, and whom it is for, never changes after enqueue.
CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON ops
WHEN NEW.outbox IS NOT OLD.outbox OR NEW.kind IS NOT OLD.kind OR NEW.lanes IS NOT OLD.lanes
  OR NEW.payload IS NOT OLD.payload OR NEW.idempotency_key IS NOT OLD.idempotency_key
  OR NEW.created_at IS NOT OLD.created_at
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable');
END;

-- One row per delivery attempt: the history operators read.
CREATE TABLE attempts (
    op_id       INTEGER NOT NULL REFERENCES ops (id),
    attempt     INTEGER NOT NULL CHECK (attempt >= 1),
    started_at  INTEGER NOT NULL,
    finished_at INTEGER NOT NULL,
    outcome     TEXT    NOT NULL
                CHECK (outcome IN ('confirmed', 'retryable', 'permanent', 'plugin_fault', 'lease_expired')),
    detail      TEXT,
    fee         INTEGER,
    error       TEXT,
    PRIMARY KEY (op_id, attempt)
);

-- Subjects (users, actors) whose ops must not be dispatched (compliance halt).
CREATE TABLE halted_subjects (
    subject   TEXT    PRIMARY KEY,
    reason    TEXT,
    halted_at INTEGER NOT NULL
);
