-- An outbox's ops are read in id order without making writers wait for
-- each other.
--
-- Migration 20261203000002 made ids of an outbox commit in order by an
-- exclusive per-outbox lock held from a writer's first insert to its
-- commit. That lock was also a wait: an API enqueue waited behind a
-- producer's open transaction, and two producers inserting into two
-- outboxes in opposite orders deadlocked (PostgreSQL failed one with
-- 40P01).
--
-- Now a writer announces itself instead of excluding others. Before it
-- takes its first id in an outbox it takes a *shared* transaction lock
-- keyed by the outbox and by the sequence's last value L at that moment
-- (every id it takes afterwards is larger than L). Shared locks never wait
-- for each other. The drain asks laneway_ops_horizon(outbox) for the
-- first id it may not read yet: one past the smallest L an open writer of
-- the outbox announced, or one past the sequence's value when nobody
-- writes. Every id below the horizon belongs to a transaction that has
-- committed or rolled back, so a read that stops there never passes an op
-- that is still to appear (the horizon is read before the read's snapshot
-- is taken: the drain asks in a statement of its own).
--
-- The lock's first key is a hash of laneway's schema and the outbox (two
-- installs in two schemas of one database, or the tests' parallel
-- schemas, never hold each other back; a collision only delays a read).
-- One lock per outbox and transaction: the outboxes announced are kept in
-- a transaction-local setting, so a producer inserting 100,000 ops takes
-- one lock, not 100,000 (the lock table holds a few thousand in all).
CREATE OR REPLACE FUNCTION laneway_ops_visible_in_id_order() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
DECLARE
    outbox_key INTEGER := hashtext(current_schema() || '/' || NEW.outbox);
    mark TEXT := ',' || outbox_key || ',';
    held TEXT := coalesce(current_setting('laneway.announced', true), '');
    last BIGINT;
    low  BIGINT;
BEGIN
    IF position(mark IN held) = 0 THEN
        last := coalesce(pg_sequence_last_value(pg_get_serial_sequence('ops', 'id')::regclass), 0);
        low := last % 4294967296;
        PERFORM pg_advisory_xact_lock_shared(outbox_key,
            (CASE WHEN low >= 2147483648 THEN low - 4294967296 ELSE low END)::integer);
        PERFORM set_config('laneway.announced', held || mark, true);
    END IF;
    NEW.id := nextval(pg_get_serial_sequence('ops', 'id'));
    RETURN NEW;
END
$$;

-- The first id of the outbox the drain may not read yet (see above). The
-- lock's second key holds L's low 32 bits; L is the largest value at most
-- the sequence's current one with those bits (no transaction lives
-- through four billion ids).
CREATE FUNCTION laneway_ops_horizon(of_outbox TEXT) RETURNS BIGINT LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT AS $$
DECLARE
    cap    BIGINT := coalesce(pg_sequence_last_value(pg_get_serial_sequence('ops', 'id')::regclass), 0);
    oldest BIGINT;
BEGIN
    SELECT min(cap - ((cap - l.objid::text::bigint) % 4294967296 + 4294967296) % 4294967296) INTO oldest
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2
      AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
      AND l.classid = ((hashtext(current_schema() || '/' || of_outbox)::bigint + 4294967296) % 4294967296)::text::oid;
    RETURN least(coalesce(oldest, cap), cap) + 1;
END
$$;

-- The sequence's value is read as the last id handed out: one value per
-- call, never a per-session cache of them.
DO $$
BEGIN
    EXECUTE format('ALTER SEQUENCE %s CACHE 1', pg_get_serial_sequence('ops', 'id'));
END
$$;

-- The exclusive lock also kept two producers' inserts of one idempotency
-- key apart, so the second's contract check saw the first's op. Without
-- it, the second waits at the unique index and conflicts: enqueue then
-- inserts once more, and that insert's check sees the committed op.
CREATE OR REPLACE FUNCTION enqueue(
    kind            TEXT,
    outbox          TEXT,
    payload         JSON,
    lanes           TEXT[]      DEFAULT '{}',
    priority        TEXT        DEFAULT NULL,
    idempotency_key TEXT        DEFAULT NULL,
    coalesce_key    TEXT        DEFAULT NULL,
    subject         TEXT        DEFAULT NULL,
    correlation_id  TEXT        DEFAULT NULL,
    delay_ms        BIGINT      DEFAULT NULL,
    not_before      TIMESTAMPTZ DEFAULT NULL
) RETURNS BIGINT LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    rank  SMALLINT;
    due   TIMESTAMPTZ := now();
    op_id BIGINT;
    try_no INTEGER;
BEGIN
    IF enqueue.kind IS NULL OR enqueue.outbox IS NULL OR enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'laneway: invalid_op: kind, outbox and payload are required (payload is JSON; a JSON null is ''null''::json)'
            USING ERRCODE = 'LW001';
    END IF;
    IF enqueue.priority IS NOT NULL THEN
        rank := CASE enqueue.priority WHEN 'critical' THEN 0 WHEN 'normal' THEN 1 WHEN 'low' THEN 2 END;
        IF rank IS NULL THEN
            RAISE EXCEPTION 'laneway: invalid_op: priority must be ''critical'', ''normal'' or ''low'' (or NULL for the kind''s default), got %',
                quote_literal(enqueue.priority) USING ERRCODE = 'LW001';
        END IF;
    END IF;
    IF enqueue.delay_ms IS NOT NULL THEN
        IF enqueue.delay_ms < 0 OR enqueue.delay_ms > 31536000000 THEN
            RAISE EXCEPTION 'laneway: invalid_op: delay_ms is milliseconds from now, 0 to 31536000000 (a year), got %',
                enqueue.delay_ms USING ERRCODE = 'LW001';
        END IF;
        due := greatest(due, now() + enqueue.delay_ms * interval '1 millisecond');
    END IF;
    IF enqueue.not_before IS NOT NULL AND isfinite(enqueue.not_before) THEN
        due := greatest(due, enqueue.not_before);
    ELSIF enqueue.not_before IS NOT NULL THEN
        due := enqueue.not_before; -- refused by the contract's trigger, with its message
    END IF;
    -- Twice when an idempotency key conflicted: the conflict may have been
    -- with a transaction that committed while this insert waited for it,
    -- which the contract trigger could not see; the second insert's
    -- trigger does, and refuses a key reused for another op (LW005).
    FOR try_no IN 1..2 LOOP
        INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject,
                         correlation_id, next_attempt_at)
        VALUES (enqueue.outbox, enqueue.kind, rank, COALESCE(enqueue.lanes, '{}'), enqueue.payload,
                enqueue.idempotency_key, enqueue.coalesce_key, enqueue.subject, enqueue.correlation_id, due)
        ON CONFLICT DO NOTHING
        RETURNING ops.id INTO op_id;
        IF op_id IS NOT NULL THEN
            RETURN op_id;
        END IF;
        EXIT WHEN enqueue.idempotency_key IS NULL;
    END LOOP;
    IF enqueue.idempotency_key IS NOT NULL THEN
        SELECT o.id INTO op_id FROM ops o
        WHERE o.outbox = enqueue.outbox AND o.idempotency_key = enqueue.idempotency_key;
        IF op_id IS NOT NULL THEN
            RETURN op_id;
        END IF;
        SELECT t.op_id INTO op_id FROM idempotency_tombstones t
        WHERE t.outbox = enqueue.outbox AND t.idempotency_key = enqueue.idempotency_key;
        IF op_id IS NOT NULL THEN
            RETURN op_id;
        END IF;
    END IF;
    IF enqueue.coalesce_key IS NOT NULL THEN
        SELECT o.id INTO op_id FROM ops o
        WHERE o.outbox = enqueue.outbox AND o.coalesce_key = enqueue.coalesce_key
          AND o.status IN ('pending', 'submitted');
        IF op_id IS NOT NULL THEN
            RETURN op_id;
        END IF;
    END IF;
    RAISE EXCEPTION 'laneway: conflict: the op conflicted with a concurrent change; run the transaction again'
        USING ERRCODE = '40001';
END
$$;

-- enqueue_many no longer locks its outboxes first: nothing waits.
CREATE OR REPLACE FUNCTION enqueue_many(ops JSONB) RETURNS SETOF BIGINT LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    op      JSONB;
    n       INTEGER := 0;
    unknown TEXT;
BEGIN
    IF jsonb_typeof(enqueue_many.ops) IS DISTINCT FROM 'array'
        OR jsonb_array_length(enqueue_many.ops) NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'laneway: invalid_op: enqueue_many takes a JSON array of 1 to 1000 ops'
            USING ERRCODE = 'LW001';
    END IF;
    FOR op IN SELECT e FROM jsonb_array_elements(enqueue_many.ops) e LOOP
        IF jsonb_typeof(op) IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION 'laneway: invalid_op: ops[%] is not a JSON object', n USING ERRCODE = 'LW001';
        END IF;
        SELECT k INTO unknown FROM jsonb_object_keys(op) k
        WHERE k NOT IN ('kind', 'outbox', 'payload', 'lanes', 'priority', 'idempotency_key', 'coalesce_key',
                        'subject', 'correlation_id', 'delay_ms', 'not_before')
        LIMIT 1;
        IF unknown IS NOT NULL THEN
            RAISE EXCEPTION 'laneway: invalid_op: ops[%] has unknown field %', n, quote_literal(unknown)
                USING ERRCODE = 'LW001';
        END IF;
        IF jsonb_typeof(op -> 'outbox') IS DISTINCT FROM 'string' OR jsonb_typeof(op -> 'kind') IS DISTINCT FROM 'string'
            OR NOT (op ? 'payload') THEN
            RAISE EXCEPTION 'laneway: invalid_op: ops[%] needs kind and outbox (strings) and payload (any JSON)', n
                USING ERRCODE = 'LW001';
        END IF;
        IF op ? 'lanes' AND (jsonb_typeof(op -> 'lanes') IS DISTINCT FROM 'array'
            OR EXISTS (SELECT 1 FROM jsonb_array_elements(op -> 'lanes') l WHERE jsonb_typeof(l) <> 'string')) THEN
            RAISE EXCEPTION 'laneway: invalid_op: ops[%].lanes must be an array of strings', n USING ERRCODE = 'LW001';
        END IF;
        IF EXISTS (SELECT 1 FROM jsonb_each(op) f
                   WHERE f.key IN ('priority', 'idempotency_key', 'coalesce_key', 'subject', 'correlation_id', 'not_before')
                     AND jsonb_typeof(f.value) NOT IN ('string', 'null'))
            OR (op ? 'delay_ms' AND jsonb_typeof(op -> 'delay_ms') NOT IN ('number', 'null')) THEN
            RAISE EXCEPTION 'laneway: invalid_op: ops[%]: priority, the keys, subject, correlation_id and not_before are strings; delay_ms a number', n
                USING ERRCODE = 'LW001';
        END IF;
        n := n + 1;
    END LOOP;
    FOR op IN SELECT e FROM jsonb_array_elements(enqueue_many.ops) e LOOP
        RETURN NEXT enqueue(
            kind => op ->> 'kind',
            outbox => op ->> 'outbox',
            payload => (op -> 'payload')::json,
            lanes => COALESCE(ARRAY(SELECT jsonb_array_elements_text(op -> 'lanes')), '{}'),
            priority => op ->> 'priority',
            idempotency_key => op ->> 'idempotency_key',
            coalesce_key => op ->> 'coalesce_key',
            subject => op ->> 'subject',
            correlation_id => op ->> 'correlation_id',
            delay_ms => (op ->> 'delay_ms')::numeric::bigint,
            not_before => (op ->> 'not_before')::timestamptz);
    END LOOP;
END
$$;
