-- Retention (PostgreSQL): idempotency keys outlive their pruned ops as
-- compact tombstones, so a repeated key still answers `existing` with the
-- outcome. `expires_at` NULL keeps it forever.
CREATE TABLE idempotency_tombstones (
    outbox          TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    op_id           BIGINT      NOT NULL,
    kind            TEXT        NOT NULL,
    status          TEXT        NOT NULL CHECK (status IN ('confirmed', 'failed', 'cancelled')),
    receipt         TEXT,
    finished_at     TIMESTAMPTZ NOT NULL,
    expires_at      TIMESTAMPTZ,
    PRIMARY KEY (outbox, idempotency_key)
);
CREATE INDEX idempotency_tombstones_expiry ON idempotency_tombstones (expires_at)
    WHERE expires_at IS NOT NULL;

-- Every writer's insert of a tombstoned key is skipped (the row is not
-- inserted, as with `ON CONFLICT DO NOTHING`), so a plain-SQL producer
-- retrying a key whose op was pruned cannot cause the side effect twice.
-- The pruner commits the tombstone before it deletes the op, so an insert
-- sees one or the other.
CREATE FUNCTION laneway_ops_tombstoned() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.idempotency_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM idempotency_tombstones t
        WHERE t.outbox = NEW.outbox AND t.idempotency_key = NEW.idempotency_key) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER ops_tombstoned BEFORE INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_tombstoned();

-- Work one host does at a time (the pruner), by lease: a host takes or
-- renews the row when it is free, expired, or already its own.
CREATE TABLE singletons (
    name  TEXT        PRIMARY KEY,
    owner TEXT        NOT NULL,
    until TIMESTAMPTZ NOT NULL
);

-- Named positions in the outcome feed (the webhook relay's), so a restart
-- goes on where the last run stopped.
CREATE TABLE feed_cursors (
    name   TEXT PRIMARY KEY,
    cursor TEXT NOT NULL
);
