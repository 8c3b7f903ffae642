-- A producer that enqueues with SQL on PostgreSQL, in its own transaction:
-- the business row and the op that delivers its side effect commit
-- together or not at all (the transactional outbox), through the producer
-- contract's function laneway.enqueue(...) (docs/producers.md), and running
-- laneway hosts are woken by the NOTIFY its insert sends.
--
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f examples/plain_sql_producer.sql
--
-- Run against a database laneway has migrated (`laneway migrate`), from the
-- application's own search path: laneway's objects are in their own schema,
-- `laneway` unless `[database] schema` says otherwise (then pass
-- `-v laneway_schema=NAME`). The script LISTENs on laneway's channel first,
-- so psql prints the wake-up ("Asynchronous notification "laneway_ops" with
-- payload "platform" …"). Running it twice enqueues nothing new: the
-- idempotency key names the op the first run made.

\set ON_ERROR_STOP on
\if :{?laneway_schema}
\else
    \set laneway_schema laneway
\endif

SELECT :'laneway_schema' || '.contract_version()' AS contract, :"laneway_schema".contract_version() AS version;

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

-- Named arguments; `priority` is left out, so the kind's configured default
-- applies (`withdraw` is critical). A Stellar kind's plugin names its lanes
-- (the signer account), which SQL cannot ask for: this producer names the
-- signer's account, as `laneway keys show KEY` prints it. The answer is the
-- op's id: new, or the op the idempotency key already names.
SELECT :"laneway_schema".enqueue(
    kind            => 'withdraw',
    outbox          => 'platform',
    payload         => '{"user": "GUSER7EXAMPLE", "amount": "2500000", "tx": "tx-991"}',
    lanes           => ARRAY['GSIGNEREXAMPLE'],
    idempotency_key => 'withdraw:user-7:tx-991',
    subject         => 'user-7',
    correlation_id  => 'tx-991'
) AS op_id;

COMMIT;

-- What laneway will deliver: pending, critical (0), in the signer's lane.
SELECT id, status, priority, lanes, idempotency_key
FROM :"laneway_schema".ops
WHERE idempotency_key = 'withdraw:user-7:tx-991';
