-- Small shared records (SQLite): what every host must agree on about the
-- world outside the queue, keyed by a namespace and a key, each a JSON
-- value with a version for compare-and-set. Destination health, gone
-- inboxes, shared-inbox marks, per-destination notes plugins keep (the
-- signature scheme a server accepts) and rate-limit buckets live here.
CREATE TABLE records (
    namespace  TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    value      TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
