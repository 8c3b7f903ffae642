-- The schema's own bookkeeping. PostgreSQL alters tables in place inside
-- transactions and wakes hosts with LISTEN/NOTIFY, so SQLite's foreign-key
-- switch and wake-up watcher have no counterpart here.

-- name: migrations_table_exists
SELECT to_regclass('_sqlx_migrations') IS NOT NULL

-- name: applied_migrations
SELECT version FROM _sqlx_migrations WHERE success

-- none: foreign_keys_off: migrations alter tables in place, keys stay on
-- none: foreign_keys_on: as foreign_keys_off
-- none: foreign_key_violations: as foreign_keys_off
-- none: data_version: producers wake hosts by NOTIFY from the insert trigger
-- none: wakeup_counters: as data_version
