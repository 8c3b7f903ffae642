-- A channel pool's op may be re-dealt another channel while it waits with
-- no receipt: nothing of it can be on chain, so its channel (its one lane)
-- says only which account will send it. Every other lane stays fixed from
-- enqueue on, as before.
--
-- Each move is recorded here in the transaction that makes it, and the
-- identity trigger lets an op's lanes change only when such a record names
-- the very move (op, from, to, at this update): a stray UPDATE of lanes is
-- still refused, and an operator can see why an op's channel changed.
CREATE TABLE lane_redeals (
    op_id      INTEGER NOT NULL,
    from_lane  TEXT    NOT NULL,
    to_lane    TEXT    NOT NULL,
    redealt_at INTEGER NOT NULL,
    PRIMARY KEY (op_id, redealt_at)
);

DROP TRIGGER ops_identity_immutable;
CREATE TRIGGER ops_identity_immutable BEFORE UPDATE OF outbox, kind, lanes, payload, idempotency_key, created_at ON ops
WHEN NEW.outbox IS NOT OLD.outbox OR NEW.kind IS NOT OLD.kind
  OR NEW.payload IS NOT OLD.payload OR NEW.idempotency_key IS NOT OLD.idempotency_key
  OR NEW.created_at IS NOT OLD.created_at
  OR (NEW.lanes IS NOT OLD.lanes AND NOT (
        OLD.status = 'pending' AND OLD.receipt IS NULL AND NEW.status = 'pending' AND NEW.receipt IS NULL
        AND json_array_length(OLD.lanes) = 1 AND json_array_length(NEW.lanes) = 1
        AND EXISTS (SELECT 1 FROM lane_redeals r WHERE r.op_id = NEW.id AND r.redealt_at = NEW.updated_at
                    AND r.from_lane = json_extract(OLD.lanes, '$[0]') AND r.to_lane = json_extract(NEW.lanes, '$[0]'))))
BEGIN
    SELECT RAISE(ABORT, 'laneway: an op''s outbox, kind, lanes, payload and idempotency key are immutable');
END;
