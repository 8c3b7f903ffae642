-- A dead letter laneway set aside because it could not read the op (a
-- value written before the producer contract, or by a hand edit past every
-- check) has an attempt class of its own, `invalid`: it was never tried,
-- and an operator grouping dead letters by class (`dead_letter_groups`,
-- the console) sees it as such instead of as a class-less row. The ops the
-- earlier migrations set aside get their `invalid` attempt row here.
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('confirmed', 'retryable', 'permanent', 'plugin_fault', 'lease_expired', 'invalid'));

-- The row is the op's last attempt (attempts + 1), which is where an
-- operator's view of a dead letter looks for its class.
INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, error)
SELECT o.id, o.attempts + 1, COALESCE(o.finished_at, o.updated_at), COALESCE(o.finished_at, o.updated_at), 'invalid',
    o.last_error
FROM ops o
WHERE o.status = 'failed'
  AND (o.last_error LIKE 'invalid: a time laneway cannot read:%'
       OR o.last_error LIKE 'invalid: a value laneway cannot read:%'
       OR o.last_error LIKE 'invalid: written before the producer contract%');
UPDATE ops SET attempts = attempts + 1
WHERE id IN (SELECT op_id FROM attempts WHERE outcome = 'invalid');
