-- laneway's own kinds are enqueued by laneway only, each in its own
-- outboxes: outcome webhooks in `outcomes:OUTBOX`, verified inbound
-- activities in `inbound`. A plain-SQL producer writing one anywhere else is
-- refused. (The database is inside laneway's trust boundary: this stops a
-- mistake, not a writer who can also update any row; the API and the CLI
-- refuse these kinds outright, and the webhook executor takes its URL and
-- key from the config, never from the payload.)
CREATE FUNCTION laneway_ops_internal_kind() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.kind = 'outcome_webhook' AND NEW.outbox NOT LIKE 'outcomes:%')
        OR (NEW.kind = 'activitypub_inbound' AND NEW.outbox <> 'inbound') THEN
        RAISE EXCEPTION 'kind % is laneway''s own; producers cannot enqueue it', NEW.kind
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER ops_internal_kind BEFORE INSERT ON ops
    FOR EACH ROW EXECUTE FUNCTION laneway_ops_internal_kind();
