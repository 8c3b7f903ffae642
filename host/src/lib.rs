//! laneway: a WebAssembly-pluggable delivery host.
//!
//! The host owns the durable queue ([`queue`]), the op lifecycle ([`op`]),
//! configuration ([`config`]) and the operator CLI ([`cli`]). See
//! `ARCHITECTURE.md` for the map and the invariants.
#![forbid(unsafe_code)]

pub mod api;
pub mod archive;
pub mod bench;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod demo;
pub mod destinations;
pub mod dispatch;
pub mod egress;
pub mod enqueue;
pub mod events;
pub mod executor;
pub mod failpoint;
pub mod fanout;
pub mod fees;
pub mod health;
pub mod inbound;
pub mod keys;
pub mod lanes;
pub mod node;
pub mod op;
pub mod oracle;
pub mod outcome;
pub mod pool;
pub mod pricing;
pub mod pruner;
pub mod queue;
pub mod ratelimit;
pub mod retention;
pub mod retry;
pub mod runtime;
pub mod webhook;
