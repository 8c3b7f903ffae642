-- The fee oracle's latest snapshot per oracle, shared by every host. Written
-- by whichever host polled last; never goes back in time.
CREATE TABLE fee_snapshots (
    oracle     TEXT        PRIMARY KEY,
    snapshot   JSON        NOT NULL,
    sampled_at TIMESTAMPTZ NOT NULL
);
