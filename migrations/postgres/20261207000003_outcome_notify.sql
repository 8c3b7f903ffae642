-- A producer listening for outcomes learns whose op it was without a
-- look-up: `NOTIFY laneway_op_outcomes` carries a JSON object naming the
-- op, its outbox, kind, status, idempotency key and correlation id (each
-- name at most 2048 bytes, well inside NOTIFY's 8000). The older
-- `laneway_outcomes, '<op id> <status>'` stays as it was for listeners
-- written against it.
CREATE OR REPLACE FUNCTION laneway_ops_outcome() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO outcomes (op_id, status, at) VALUES (NEW.id, NEW.status, NEW.updated_at);
    PERFORM pg_notify('laneway_outcomes', NEW.id::text || ' ' || NEW.status);
    PERFORM pg_notify('laneway_op_outcomes', json_build_object(
        'id', NEW.id, 'outbox', NEW.outbox, 'kind', NEW.kind, 'status', NEW.status,
        'idempotency_key', NEW.idempotency_key, 'correlation_id', NEW.correlation_id)::text);
    RETURN NULL;
END
$$;
