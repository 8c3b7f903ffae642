-- The lane_occupants triggers' DELETE joins the statement's transition
-- table to lane_occupants on (op_id, lane = ANY(lanes)). The transition
-- table has no statistics and lane_occupants' often say "nearly empty" (it
-- churns faster than autovacuum analyzes it), so the planner chose a nested
-- loop over a sequential scan of every occupant, every op in flight on
-- every host: a 400-op settle with 400 in flight spent ~110 ms in that one
-- statement, and a settle's cost grew with the ops in flight.
--
-- Rewriting the join as equality on (lane, op_id) does not change that
-- plan; keeping the planner off sequential scans inside these two
-- functions does, whatever the statistics say: the transition tables are
-- still read whole (they have no index), and lane_occupants is reached by
-- its primary key. Turning off nested loops instead makes claims and
-- settles 15-30x slower; it is not done.
ALTER FUNCTION laneway_lane_occupants_changed() SET enable_seqscan = off;
ALTER FUNCTION laneway_lane_occupants_deleted() SET enable_seqscan = off;
