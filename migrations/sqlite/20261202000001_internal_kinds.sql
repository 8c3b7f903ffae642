-- laneway's own kinds are enqueued by laneway only, each in its own
-- outboxes: outcome webhooks in `outcomes:OUTBOX`, verified inbound
-- activities in `inbound`. A plain-SQL producer writing one anywhere else is
-- refused. (The database is inside laneway's trust boundary: this stops a
-- mistake, not a writer who can also update any row; the API and the CLI
-- refuse these kinds outright, and the webhook executor takes its URL and
-- key from the config, never from the payload.)
CREATE TRIGGER ops_internal_kind BEFORE INSERT ON ops
WHEN (NEW.kind = 'outcome_webhook' AND NEW.outbox NOT LIKE 'outcomes:%')
    OR (NEW.kind = 'activitypub_inbound' AND NEW.outbox <> 'inbound')
BEGIN
    SELECT RAISE(ABORT, 'kind is laneway''s own; producers cannot enqueue it');
END;
