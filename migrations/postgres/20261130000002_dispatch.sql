-- Dispatcher state (PostgreSQL).

-- At most one drain per outbox at a time, across hosts: a lease row the
-- holder renews while it drains and that another host takes once it lapses.
CREATE TABLE drain_slots (
    outbox      TEXT        PRIMARY KEY,
    owner       TEXT        NOT NULL,
    token       UUID        NOT NULL,
    lease_until TIMESTAMPTZ NOT NULL
);

-- Strict lanes held by a dead letter under the `halt` poison policy, until an
-- operator skips the lane or retries the op.
CREATE TABLE lane_halts (
    outbox    TEXT        NOT NULL,
    lane      TEXT        NOT NULL,
    op_id     BIGINT      NOT NULL REFERENCES ops (id),
    halted_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (outbox, lane, op_id)
);
CREATE INDEX lane_halts_op ON lane_halts (op_id);

-- The scheduler reads an outbox's non-terminal ops in dispatch order.
CREATE INDEX ops_outbox_active ON ops (outbox, priority, id) WHERE status IN ('pending', 'submitted');
-- The safety-net poll finds outboxes with due work.
CREATE INDEX ops_due ON ops (next_attempt_at, outbox) WHERE status = 'pending';
