-- Every time laneway reads back is one it can read: a hand edit (an
-- operator's UPDATE, a restore gone wrong) that writes 'infinity' or a
-- year past 9999 into an op used to make every read of that op an error,
-- its outbox's drain included. The columns now refuse such values on every
-- write (the other columns' types already refuse anything unreadable).
--
-- Rows that already hold one are set aside first: a pending op becomes a
-- dead letter whose last_error starts `invalid:`; every op gets readable
-- times (now), so its outbox, `ops list`, the admin API and the outcome
-- relay go on. (created_at is immutable by trigger; the trigger is lifted
-- for this one statement.)
ALTER TABLE ops DISABLE TRIGGER ops_identity_immutable;
UPDATE ops SET
    last_error = CASE WHEN status = 'pending' THEN
        'invalid: a time laneway cannot read: next_attempt_at ' || next_attempt_at::text
        || ', created_at ' || created_at::text || ', updated_at ' || updated_at::text
        || ', lease_until ' || COALESCE(lease_until::text, 'NULL') || ', finished_at ' || COALESCE(finished_at::text, 'NULL')
        ELSE last_error END,
    finished_at = CASE WHEN status = 'pending' THEN now()
                       WHEN finished_at IS NULL OR finished_at BETWEEN '0001-01-01' AND '9999-12-31' THEN finished_at
                       ELSE now() END,
    status = CASE WHEN status = 'pending' THEN 'failed' ELSE status END,
    next_attempt_at = CASE WHEN next_attempt_at BETWEEN '0001-01-01' AND '9999-12-31' THEN next_attempt_at ELSE now() END,
    created_at = CASE WHEN created_at BETWEEN '0001-01-01' AND '9999-12-31' THEN created_at ELSE now() END,
    updated_at = now(),
    lease_until = CASE WHEN lease_until IS NULL OR lease_until BETWEEN '0001-01-01' AND '9999-12-31' THEN lease_until
                       ELSE now() END
WHERE NOT (next_attempt_at BETWEEN '0001-01-01' AND '9999-12-31')
   OR NOT (created_at BETWEEN '0001-01-01' AND '9999-12-31')
   OR NOT (updated_at BETWEEN '0001-01-01' AND '9999-12-31')
   OR NOT (COALESCE(lease_until, now()) BETWEEN '0001-01-01' AND '9999-12-31')
   OR NOT (COALESCE(finished_at, now()) BETWEEN '0001-01-01' AND '9999-12-31');
ALTER TABLE ops ENABLE TRIGGER ops_identity_immutable;

ALTER TABLE ops
    ADD CONSTRAINT ops_times_readable CHECK (
        next_attempt_at BETWEEN '0001-01-01' AND '9999-12-31'
        AND created_at BETWEEN '0001-01-01' AND '9999-12-31'
        AND updated_at BETWEEN '0001-01-01' AND '9999-12-31'
        AND (lease_until IS NULL OR lease_until BETWEEN '0001-01-01' AND '9999-12-31')
        AND (finished_at IS NULL OR finished_at BETWEEN '0001-01-01' AND '9999-12-31'));
