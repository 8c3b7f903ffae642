-- laneway's tables share the application's SQLite file (a transaction that
-- spans two attached files is not atomic in WAL mode, and the outbox's
-- whole point is one transaction), so none of them may take a name an
-- application is likely to have: every one is now `laneway_…` (SQLite
-- rewrites the triggers, indexes and foreign keys that name them). The
-- producer contract's table is `laneway_ops` (docs/producers.md).
ALTER TABLE ops RENAME TO laneway_ops;
ALTER TABLE op_lanes RENAME TO laneway_op_lanes;
ALTER TABLE attempts RENAME TO laneway_attempts;
ALTER TABLE fee_snapshots RENAME TO laneway_fee_snapshots;
ALTER TABLE drain_slots RENAME TO laneway_drain_slots;
ALTER TABLE kind_defaults RENAME TO laneway_kind_defaults;
ALTER TABLE outbox_wakeups RENAME TO laneway_outbox_wakeups;
ALTER TABLE hosts RENAME TO laneway_hosts;
ALTER TABLE api_keys RENAME TO laneway_api_keys;
ALTER TABLE audit_log RENAME TO laneway_audit_log;
ALTER TABLE pauses RENAME TO laneway_pauses;
ALTER TABLE halted_subjects RENAME TO laneway_halted_subjects;
ALTER TABLE lane_halts RENAME TO laneway_lane_halts;
ALTER TABLE outcomes RENAME TO laneway_outcomes;
ALTER TABLE idempotency_tombstones RENAME TO laneway_idempotency_tombstones;
ALTER TABLE singletons RENAME TO laneway_singletons;
ALTER TABLE feed_cursors RENAME TO laneway_feed_cursors;
ALTER TABLE payloads RENAME TO laneway_payloads;
ALTER TABLE records RENAME TO laneway_records;
ALTER TABLE lane_redeals RENAME TO laneway_lane_redeals;
