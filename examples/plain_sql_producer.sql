-- A producer that enqueues with plain SQL on PostgreSQL, in its own
-- transaction: the business row and the op that delivers its side effect
-- commit together or not at all (the transactional outbox), and running
-- laneway hosts are woken by the NOTIFY the ops trigger sends.
--
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f examples/plain_sql_producer.sql
--
-- Run against a database laneway has migrated (`laneway migrate`). The
-- script LISTENs on laneway's channel first, so psql prints the wake-up
-- ("Asynchronous notification "laneway_ops" with payload "platform" …").
-- Running it twice enqueues nothing new: the idempotency key makes the
-- insert an upsert.

\set ON_ERROR_STOP on

LISTEN laneway_ops;

-- The application's own table (here only for the example).
CREATE TABLE IF NOT EXISTS example_withdrawals (
    id         TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL,
    amount     BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

BEGIN;

INSERT INTO example_withdrawals (id, user_id, amount)
VALUES ('tx-991', 'user-7', 2500000)
ON CONFLICT (id) DO NOTHING;

-- Only the columns a producer may write. `priority` is left out, so the
-- kind's configured default applies (`withdraw` is critical); `lanes` is the
-- signer account, as `laneway keys show KEY` prints it.
INSERT INTO ops (outbox, kind, payload, lanes, idempotency_key, subject, correlation_id)
VALUES (
    'platform',
    'withdraw',
    '{"user": "GUSER7EXAMPLE", "amount": "2500000", "tx": "tx-991"}',
    ARRAY['GSIGNEREXAMPLE'],
    'withdraw:user-7:tx-991',
    'user-7',
    'tx-991'
)
ON CONFLICT DO NOTHING;

COMMIT;

-- What laneway will deliver: pending, critical (0), in the signer's lane.
SELECT id, status, priority, lanes, idempotency_key
FROM ops
WHERE idempotency_key = 'withdraw:user-7:tx-991';
