-- Shared records (a JSON value under a namespace and key, versioned for
-- compare-and-set), one-host-at-a-time leases, feed cursors, fee snapshots.

-- name: record
SELECT key, value, version, updated_at FROM laneway_records AS records WHERE namespace = $1 AND key = $2

-- name: records
SELECT key, value, version, updated_at FROM laneway_records AS records WHERE namespace = $1 ORDER BY key

-- name: records_by_keys
SELECT key, value, version, updated_at FROM laneway_records AS records WHERE namespace = $1
    AND key IN (SELECT value FROM json_each($2)) ORDER BY key

-- name: insert_record
INSERT INTO laneway_records AS records (namespace, key, value, version, updated_at) VALUES ($1, $2, $3, 1, $4)
ON CONFLICT (namespace, key) DO NOTHING

-- name: update_record
UPDATE laneway_records AS records SET value = $3, version = version + 1, updated_at = $4 WHERE namespace = $1 AND key = $2 AND version = $5

-- name: upsert_record
INSERT INTO laneway_records AS records (namespace, key, value, version, updated_at) VALUES ($1, $2, $3, 1, $4)
ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, version = records.version + 1,
    updated_at = excluded.updated_at

-- name: delete_record
DELETE FROM laneway_records AS records WHERE namespace = $1 AND key = $2 AND ($3 IS NULL OR version = $3)

-- name: hold_singleton
INSERT INTO laneway_singletons AS singletons (name, owner, until) VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, until = excluded.until
WHERE singletons.until < $4 OR singletons.owner = excluded.owner
RETURNING owner

-- name: feed_cursor
SELECT cursor FROM laneway_feed_cursors AS feed_cursors WHERE name = $1

-- name: set_feed_cursor
INSERT INTO laneway_feed_cursors AS feed_cursors (name, cursor) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET cursor = $2

-- Stored unless a newer snapshot is.
-- name: put_fee_snapshot
INSERT INTO laneway_fee_snapshots AS fee_snapshots (oracle, snapshot, sampled_at) VALUES ($1, $2, $3)
ON CONFLICT (oracle) DO UPDATE SET snapshot = excluded.snapshot, sampled_at = excluded.sampled_at
WHERE fee_snapshots.sampled_at < excluded.sampled_at

-- name: fee_snapshot
SELECT snapshot, sampled_at FROM laneway_fee_snapshots AS fee_snapshots WHERE oracle = $1
