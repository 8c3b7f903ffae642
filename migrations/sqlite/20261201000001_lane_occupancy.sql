-- Lanes are resources shared across outboxes: the scheduler and the claim
-- read every op that occupies a lane (in flight, or pending with a receipt
-- in doubt, which holds its lanes until it is reconciled). Those are few (a
-- host's in-flight cap), so they get an index of their own.
CREATE INDEX ops_occupying ON ops (id)
    WHERE status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL);
