-- The schema's own bookkeeping, and what only SQLite needs: foreign keys
-- off while migrations rebuild tables, and the wake-up watcher's reads.

-- name: migrations_table_exists
SELECT COUNT(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'

-- name: applied_migrations
SELECT version FROM _sqlx_migrations WHERE success

-- A migration that rebuilds a table (SQLite cannot alter a column in place)
-- must run with foreign keys off, which SQLite allows only outside a
-- transaction; every key is checked afterwards.
-- name: foreign_keys_off
PRAGMA foreign_keys = OFF

-- name: foreign_keys_on
PRAGMA foreign_keys = ON

-- name: foreign_key_violations
SELECT "table" FROM pragma_foreign_key_check

-- Changes whenever another connection commits.
-- name: data_version
PRAGMA data_version

-- Bumped per outbox by a trigger on ops inserts.
-- name: wakeup_counters
SELECT outbox, seq FROM laneway_outbox_wakeups AS outbox_wakeups
