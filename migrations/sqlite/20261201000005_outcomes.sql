-- The outcome feed (SQLite): one row per transition of an op into a
-- terminal status (confirmed, failed, cancelled), in commit order, written
-- by a trigger so every writer's transitions are in it (the drain's settle,
-- lease recovery, an operator's cancel). A retried dead letter that later
-- confirms has two rows. Pollers page by `seq`; it survives restarts.
CREATE TABLE outcomes (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    op_id  INTEGER NOT NULL,
    status TEXT    NOT NULL CHECK (status IN ('confirmed', 'failed', 'cancelled')),
    at     INTEGER NOT NULL
);
CREATE INDEX outcomes_op ON outcomes (op_id);

CREATE TRIGGER ops_outcome AFTER UPDATE OF status ON ops
WHEN NEW.status IN ('confirmed', 'failed', 'cancelled') AND NEW.status IS NOT OLD.status
BEGIN
    INSERT INTO outcomes (op_id, status, at) VALUES (NEW.id, NEW.status, NEW.updated_at);
END;
