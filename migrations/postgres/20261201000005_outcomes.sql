-- The outcome feed (PostgreSQL): one row per transition of an op into a
-- terminal status (confirmed, failed, cancelled), written by a trigger so
-- every writer's transitions are in it (the drain's settle, lease recovery,
-- an operator's cancel), and `NOTIFY laneway_outcomes, '<op id> <status>'`
-- for listeners.
--
-- Pollers page in (xid, seq) order and are served only rows whose writing
-- transaction is older than every transaction still running
-- (`pg_snapshot_xmin`). A sequence alone would not do: a transaction that
-- draws seq 5 and commits after another that drew seq 6 would be skipped
-- by a cursor already past 6. Every row written later has a larger xid than
-- any row served, so the cursor never passes a row that is yet to appear.
CREATE TABLE outcomes (
    seq    BIGSERIAL   PRIMARY KEY,
    xid    xid8        NOT NULL DEFAULT pg_current_xact_id(),
    op_id  BIGINT      NOT NULL,
    status TEXT        NOT NULL CHECK (status IN ('confirmed', 'failed', 'cancelled')),
    at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX outcomes_feed ON outcomes (xid, seq);
CREATE INDEX outcomes_op ON outcomes (op_id);

CREATE FUNCTION laneway_ops_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outcomes (op_id, status, at) VALUES (NEW.id, NEW.status, NEW.updated_at);
    PERFORM pg_notify('laneway_outcomes', NEW.id::text || ' ' || NEW.status);
    RETURN NULL;
END
$$;
CREATE TRIGGER ops_outcome AFTER UPDATE OF status ON ops
    FOR EACH ROW
    WHEN (NEW.status IN ('confirmed', 'failed', 'cancelled') AND NEW.status IS DISTINCT FROM OLD.status)
    EXECUTE FUNCTION laneway_ops_outcome();
