-- The producer contract's front door on PostgreSQL (docs/producers.md):
-- laneway.enqueue(...), laneway.enqueue_many(jsonb) and
-- laneway.contract_version(), in laneway's own schema, callable inside any
-- transaction of the application's.
--
-- laneway runs its migrations with `search_path` set to its schema
-- (`[database] schema`, `laneway` by default). Every laneway function
-- keeps that path (`SET search_path FROM CURRENT`), so a trigger fired by
-- a producer whose own search_path is `public` still finds `kind_defaults`
-- and the rest, and no object of the application's can stand in for one of
-- laneway's.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema())
               AND p.proname LIKE 'laneway\_%'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path FROM CURRENT', f);
    END LOOP;
END
$$;

-- The contract's version: what a producer checks before it relies on it.
CREATE FUNCTION contract_version() RETURNS INTEGER LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT version FROM laneway_contract WHERE id = 1
$$;

-- One op, checked as the API checks it (the insert trigger,
-- laneway_ops_contract), inside the caller's transaction. Returns the id of
-- the op that carries the intent: the new op; the op an idempotency key
-- already names (the same op, or the contract refuses it with LW005), also
-- after it was pruned; or the op a coalesce key already has pending.
--   priority   'critical', 'normal' or 'low'; NULL: the kind's default
--   delay_ms   milliseconds from now before the first attempt (0 to one year)
--   not_before the earliest first attempt (the later of the two applies)
CREATE FUNCTION enqueue(
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
    INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject,
                     correlation_id, next_attempt_at)
    VALUES (enqueue.outbox, enqueue.kind, rank, COALESCE(enqueue.lanes, '{}'), enqueue.payload,
            enqueue.idempotency_key, enqueue.coalesce_key, enqueue.subject, enqueue.correlation_id, due)
    ON CONFLICT DO NOTHING
    RETURNING ops.id INTO op_id;
    IF op_id IS NOT NULL THEN
        RETURN op_id;
    END IF;
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

-- Several ops, all or nothing, each as laneway.enqueue takes it: a JSON
-- array (1 to 1000) of objects with enqueue's argument names. Returns their
-- ids in the array's order. Their outboxes are locked first, in the order
-- every laneway writer takes them, so two producers' batches over the same
-- outboxes queue rather than deadlock.
CREATE FUNCTION enqueue_many(ops JSONB) RETURNS SETOF BIGINT LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
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
    PERFORM count(pg_advisory_xact_lock(1819768953, h))
    FROM (SELECT DISTINCT hashtext(e ->> 'outbox') AS h FROM jsonb_array_elements(enqueue_many.ops) e ORDER BY h) sorted;
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
