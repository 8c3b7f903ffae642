-- The operator surface (SQLite): API keys, the audit log, pauses.
-- Timestamps are Unix milliseconds.

-- A key is `lw_<id>_<secret>`; only the secret's SHA-256 is stored, so the
-- database never holds a usable key.
CREATE TABLE api_keys (
    id          TEXT    PRIMARY KEY,
    name        TEXT    NOT NULL UNIQUE,
    secret_hash BLOB    NOT NULL,
    -- Space-separated scopes, e.g. "outbox:read outbox:write".
    scopes      TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);

-- Every operator write, by whom, on what, with the state before and after
-- (JSON). Append-only.
CREATE TABLE audit_log (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    at     INTEGER NOT NULL,
    actor  TEXT    NOT NULL,
    action TEXT    NOT NULL,
    target TEXT    NOT NULL,
    before TEXT,
    after  TEXT
);

-- Paused kinds, outboxes and destination hosts: their ops wait (holding
-- their strict lanes) without using attempts, on every host.
CREATE TABLE pauses (
    scope     TEXT    NOT NULL CHECK (scope IN ('kind', 'outbox', 'destination')),
    target    TEXT    NOT NULL,
    reason    TEXT,
    actor     TEXT    NOT NULL,
    paused_at INTEGER NOT NULL,
    PRIMARY KEY (scope, target)
);
