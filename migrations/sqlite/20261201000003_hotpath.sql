-- Wake-ups across processes. SQLite has no NOTIFY: every insert into ops
-- bumps its outbox's counter in the same transaction, and a running host
-- that sees another connection commit (PRAGMA data_version) reads the
-- counters to learn which outboxes have new ops. Plain-SQL producers get
-- this without doing anything.
CREATE TABLE outbox_wakeups (
    outbox TEXT PRIMARY KEY,
    seq    INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE TRIGGER ops_wakeup AFTER INSERT ON ops
BEGIN
    INSERT OR IGNORE INTO outbox_wakeups (outbox, seq) VALUES (NEW.outbox, 0);
    UPDATE outbox_wakeups SET seq = seq + 1 WHERE outbox = NEW.outbox;
END;


-- Hosts announce themselves here at every poll, so a host holding more than
-- its share of the busy outboxes' drain slots hands some back.
CREATE TABLE hosts (
    owner      TEXT    PRIMARY KEY,
    seen_until INTEGER NOT NULL
) WITHOUT ROWID;
