-- The fee oracle's latest snapshot per oracle, shared by every process that
-- uses the database. Written by whichever host polled last; never goes back
-- in time.
CREATE TABLE fee_snapshots (
    oracle     TEXT    PRIMARY KEY,
    snapshot   TEXT    NOT NULL CHECK (json_valid(snapshot)),
    sampled_at INTEGER NOT NULL
);
