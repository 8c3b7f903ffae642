-- The producer contract, version 1 (docs/producers.md): what a row written
-- into `ops` by anyone (laneway, a client library, a producer's own SQL)
-- must be, checked at insert, so that no row laneway cannot read or run
-- ever reaches its drain. The column types already refuse what SQLite's
-- triggers have to; this adds what they cannot say:
-- * always: non-blank names of at most 2048 bytes, lanes a flat array of
--   at most 64 such names, finite times, and none of laneway's own columns
--   (status, attempts, lease, receipt) set;
-- * once a host has registered its config here (`laneway migrate`,
--   `laneway run` and every reload do): the kind is known, lanes as the
--   kind requires, the payload within `queue.max_payload_bytes`, and an
--   idempotency key reused only for the same op.
--
-- Every refusal has its own SQLSTATE (class LW) and a message
-- `laneway: CODE: …` naming what to change, CODE being the API's error
-- code for the same refusal:
--   LW001 invalid_op, LW002 unknown_kind, LW003 lanes_required,
--   LW004 payload_too_large, LW005 idempotency_conflict.

-- The kind registry: each kind's lane rule beside its default priority.
ALTER TABLE kind_defaults ADD COLUMN lanes TEXT NOT NULL DEFAULT 'optional'
    CHECK (lanes IN ('required', 'optional', 'plugin'));

-- One row: the contract's version, and the limits the hosts registered
-- (NULL until a host with a config has: a database migrated without one
-- checks shapes only).
CREATE TABLE laneway_contract (
    id                SMALLINT    PRIMARY KEY CHECK (id = 1),
    version           INTEGER     NOT NULL,
    max_payload_bytes BIGINT,
    registered_at     TIMESTAMPTZ
);
INSERT INTO laneway_contract (id, version) VALUES (1, 1);

-- A name a producer writes: NULL (where allowed), or 1 to 2048 bytes that
-- are not all whitespace. (PostgreSQL text cannot hold NUL.)
CREATE FUNCTION laneway_bad_name(v TEXT) RETURNS BOOLEAN LANGUAGE sql IMMUTABLE AS $$
    SELECT v IS NOT NULL AND (btrim(v, E' \t\n\r\f\v') = '' OR octet_length(v) > 2048)
$$;

CREATE FUNCTION laneway_ops_contract() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    max_payload BIGINT;
    lane_rule   TEXT;
    known       BOOLEAN;
    size        BIGINT;
BEGIN
    IF laneway_bad_name(NEW.outbox) THEN
        RAISE EXCEPTION 'laneway: invalid_op: outbox must be 1 to 2048 bytes and not blank (got % bytes)',
            octet_length(NEW.outbox) USING ERRCODE = 'LW001';
    END IF;
    IF laneway_bad_name(NEW.kind) THEN
        RAISE EXCEPTION 'laneway: invalid_op: kind must be 1 to 2048 bytes and not blank' USING ERRCODE = 'LW001';
    END IF;
    IF laneway_bad_name(NEW.idempotency_key) THEN
        RAISE EXCEPTION 'laneway: invalid_op: idempotency_key must be NULL or 1 to 2048 bytes, not blank'
            USING ERRCODE = 'LW001';
    END IF;
    IF laneway_bad_name(NEW.coalesce_key) THEN
        RAISE EXCEPTION 'laneway: invalid_op: coalesce_key must be NULL or 1 to 2048 bytes, not blank'
            USING ERRCODE = 'LW001';
    END IF;
    IF laneway_bad_name(NEW.subject) THEN
        RAISE EXCEPTION 'laneway: invalid_op: subject must be NULL or 1 to 2048 bytes, not blank'
            USING ERRCODE = 'LW001';
    END IF;
    IF laneway_bad_name(NEW.correlation_id) THEN
        RAISE EXCEPTION 'laneway: invalid_op: correlation_id must be NULL or 1 to 2048 bytes, not blank'
            USING ERRCODE = 'LW001';
    END IF;
    IF NEW.lanes IS NULL OR COALESCE(array_ndims(NEW.lanes), 1) <> 1 OR cardinality(NEW.lanes) > 64 THEN
        RAISE EXCEPTION 'laneway: invalid_op: lanes must be a one-dimensional text[] of at most 64 lane names (got %)',
            COALESCE(cardinality(NEW.lanes)::text, 'NULL') USING ERRCODE = 'LW001';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(NEW.lanes) l WHERE l IS NULL OR laneway_bad_name(l)) THEN
        RAISE EXCEPTION 'laneway: invalid_op: every lane must be 1 to 2048 bytes, not NULL and not blank'
            USING ERRCODE = 'LW001';
    END IF;
    IF NOT isfinite(NEW.next_attempt_at) OR NEW.next_attempt_at >= '10000-01-01' OR NEW.next_attempt_at < '1970-01-01'
        OR NOT isfinite(NEW.created_at) OR NEW.created_at >= '10000-01-01' OR NEW.created_at < '1970-01-01'
        OR NOT isfinite(NEW.updated_at) OR NEW.updated_at >= '10000-01-01' OR NEW.updated_at < '1970-01-01' THEN
        RAISE EXCEPTION 'laneway: invalid_op: next_attempt_at must be a finite time between 1970 and 9999 (leave it out for now); created_at and updated_at are laneway''s'
            USING ERRCODE = 'LW001';
    END IF;
    IF NEW.status IS DISTINCT FROM 'pending' OR NEW.attempts IS DISTINCT FROM 0
        OR NEW.attempt_floor IS DISTINCT FROM 0 OR NEW.fee_bumps IS DISTINCT FROM 0
        OR NEW.lease_owner IS NOT NULL OR NEW.lease_token IS NOT NULL OR NEW.lease_until IS NOT NULL
        OR NEW.receipt IS NOT NULL OR NEW.last_error IS NOT NULL OR NEW.finished_at IS NOT NULL THEN
        RAISE EXCEPTION 'laneway: invalid_op: a new op is pending with no attempts, lease, receipt or error; leave status, attempts, attempt_floor, fee_bumps, lease_*, receipt, last_error and finished_at out'
            USING ERRCODE = 'LW001';
    END IF;

    -- laneway's own kinds, only in their own outboxes (before their rules:
    -- a host registers them like any kind).
    IF (NEW.kind = 'outcome_webhook' AND NEW.outbox NOT LIKE 'outcomes:%')
        OR (NEW.kind = 'activitypub_inbound' AND NEW.outbox <> 'inbound') THEN
        RAISE EXCEPTION 'laneway: internal_kind: kind % is laneway''s own (outcome webhooks, verified inbound activities); producers cannot enqueue it',
            quote_literal(NEW.kind) USING ERRCODE = 'check_violation';
    END IF;

    -- The kind's rules, once a host has registered them.
    SELECT c.max_payload_bytes INTO max_payload FROM laneway_contract c WHERE c.id = 1;
    SELECT k.lanes INTO lane_rule FROM kind_defaults k WHERE k.kind = NEW.kind;
    known := FOUND;
    IF max_payload IS NOT NULL AND NOT known
        AND NOT (NEW.kind = 'outcome_webhook' AND NEW.outbox LIKE 'outcomes:%')
        AND NOT (NEW.kind = 'activitypub_inbound' AND NEW.outbox = 'inbound') THEN
        RAISE EXCEPTION 'laneway: unknown_kind: no laneway host has kind % configured (registered kinds: %)',
            quote_literal(NEW.kind),
            COALESCE((SELECT string_agg(k.kind, ', ' ORDER BY k.kind) FROM kind_defaults k), 'none')
            USING ERRCODE = 'LW002';
    END IF;
    IF cardinality(NEW.lanes) = 0 AND lane_rule = 'required' THEN
        RAISE EXCEPTION 'laneway: lanes_required: kind % orders its ops by lane (kinds.%.lanes = "required"); name at least one lane',
            quote_literal(NEW.kind), NEW.kind USING ERRCODE = 'LW003';
    END IF;
    IF cardinality(NEW.lanes) = 0 AND lane_rule = 'plugin' THEN
        RAISE EXCEPTION 'laneway: lanes_required: kind %''s plugin names its lanes (a signer account or channel), which SQL cannot ask for; enqueue it through the HTTP API or the Rust library',
            quote_literal(NEW.kind) USING ERRCODE = 'LW003';
    END IF;
    IF max_payload IS NOT NULL THEN
        size := octet_length(NEW.payload::text);
        IF size > max_payload THEN
            RAISE EXCEPTION 'laneway: payload_too_large: the payload is % bytes, over queue.max_payload_bytes (%)',
                size, max_payload USING ERRCODE = 'LW004';
        END IF;
    END IF;
    -- An idempotency key names one op: reusing it for another kind, payload
    -- or lanes is a mistake to report, not a duplicate to answer with the
    -- first op (Stripe and Svix refuse it the same way).
    IF NEW.idempotency_key IS NOT NULL AND (
        EXISTS (SELECT 1 FROM ops o LEFT JOIN payloads p ON p.hash = o.payload_ref
                WHERE o.outbox = NEW.outbox AND o.idempotency_key = NEW.idempotency_key
                  AND (o.kind <> NEW.kind OR o.lanes IS DISTINCT FROM NEW.lanes
                       OR COALESCE(p.body, o.payload)::jsonb IS DISTINCT FROM
                          COALESCE((SELECT q.body FROM payloads q WHERE q.hash = NEW.payload_ref), NEW.payload)::jsonb))
        OR EXISTS (SELECT 1 FROM idempotency_tombstones t
                   WHERE t.outbox = NEW.outbox AND t.idempotency_key = NEW.idempotency_key AND t.kind <> NEW.kind)) THEN
        RAISE EXCEPTION 'laneway: idempotency_conflict: idempotency key % already names an op of outbox % with another kind, payload or lanes; use a new key',
            quote_literal(NEW.idempotency_key), quote_literal(NEW.outbox) USING ERRCODE = 'LW005';
    END IF;
    RETURN NEW;
END
$$;

-- Fires after ops_default_priority and before the internal-kind check, the
-- tombstone skip and the outbox lock (PostgreSQL runs a table's triggers of
-- one timing in name order).
CREATE TRIGGER ops_contract BEFORE INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_contract();
