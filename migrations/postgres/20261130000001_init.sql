-- laneway schema v1 (PostgreSQL).
-- The SQL contract for producers is in README.md ("Enqueueing with plain SQL").

CREATE TABLE ops (
    -- Id and global enqueue sequence: dispatch order is (priority, id).
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox          TEXT        NOT NULL CHECK (outbox <> ''),
    kind            TEXT        NOT NULL CHECK (kind <> ''),
    -- 0 = critical, 1 = normal, 2 = low.
    priority        SMALLINT    NOT NULL DEFAULT 1 CHECK (priority IN (0, 1, 2)),
    -- Lane names; op_lanes is filled from them by a trigger.
    lanes           TEXT[]      NOT NULL DEFAULT '{}',
    -- json (not jsonb) keeps the producer's text exactly.
    payload         JSON        NOT NULL,
    idempotency_key TEXT,
    coalesce_key    TEXT,
    subject         TEXT,
    correlation_id  TEXT,
    status          TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'submitted', 'confirmed', 'failed', 'cancelled')),
    attempts        INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    attempt_floor   INTEGER     NOT NULL DEFAULT 0 CHECK (attempt_floor >= 0),
    fee_bumps       INTEGER     NOT NULL DEFAULT 0 CHECK (fee_bumps >= 0),
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_owner     TEXT,
    lease_token     UUID,
    lease_until     TIMESTAMPTZ,
    receipt         TEXT,
    last_error      TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at     TIMESTAMPTZ,
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

-- A queue table churns: vacuum it early so dead tuples do not pile up at the
-- head of the claim index.
ALTER TABLE ops SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);

-- One row per (lane, op), so the scheduler can find each lane's head.
CREATE TABLE op_lanes (
    lane  TEXT   NOT NULL,
    op_id BIGINT NOT NULL REFERENCES ops (id),
    PRIMARY KEY (lane, op_id)
);
CREATE INDEX op_lanes_op ON op_lanes (op_id);

-- Fill op_lanes, and wake every host listening: producers that insert with
-- plain SQL in their own transactions get the same wake-up as the API.
CREATE FUNCTION laneway_ops_after_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO op_lanes (lane, op_id)
        SELECT DISTINCT l, NEW.id FROM unnest(NEW.lanes) AS l
        ON CONFLICT DO NOTHING;
    PERFORM pg_notify('laneway_ops', NEW.outbox);
    RETURN NULL;
END
$$;
CREATE TRIGGER ops_after_insert AFTER INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_after_insert();

-- What an op is, and whom it is for, never changes after enqueue.
CREATE FUNCTION laneway_ops_identity_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.outbox IS DISTINCT FROM OLD.outbox OR NEW.kind IS DISTINCT FROM OLD.kind
       OR NEW.lanes IS DISTINCT FROM OLD.lanes OR NEW.payload::text IS DISTINCT FROM OLD.payload::text
       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        RAISE EXCEPTION 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_identity_immutable();

-- One row per delivery attempt: the history operators read.
CREATE TABLE attempts (
    op_id       BIGINT      NOT NULL REFERENCES ops (id),
    attempt     INTEGER     NOT NULL CHECK (attempt >= 1),
    started_at  TIMESTAMPTZ NOT NULL,
    finished_at TIMESTAMPTZ NOT NULL,
    outcome     TEXT        NOT NULL
                CHECK (outcome IN ('confirmed', 'retryable', 'permanent', 'plugin_fault', 'lease_expired')),
    detail      TEXT,
    fee         BIGINT,
    error       TEXT,
    PRIMARY KEY (op_id, attempt)
);

-- Subjects (users, actors) whose ops must not be dispatched (compliance halt).
CREATE TABLE halted_subjects (
    subject   TEXT        PRIMARY KEY,
    reason    TEXT,
    halted_at TIMESTAMPTZ NOT NULL
);
