//! laneway's fault harness (issue 25): the real `laneway` binary as
//! separate processes against the repository's Node inboxes, ended again
//! and again by faults (failpoint aborts, kill -9, SIGSTOP past the lease,
//! PostgreSQL terminating its connections, the config rewritten in place),
//! then a checker over what the inboxes and the fake Stellar chain
//! received and the database holds.
//! GUARANTEES.md says what it proves and holds its last full result.
#![forbid(unsafe_code)]

pub mod check;
pub mod disk;
pub mod hostile;
pub mod neighbours;
pub mod procs;
pub mod proxy;
pub mod run;
pub mod stellar;
