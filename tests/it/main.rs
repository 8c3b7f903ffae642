//! laneway's integration tests: one binary, so wasmtime and sqlx link once.
//!
//! PostgreSQL tests use `TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and fail, never skip, when it
//! is unreachable.

mod activitypub;
mod api;
mod assets;
mod backend_specific;
mod bounded;
mod checks;
mod cli;
mod console;
mod demo;
mod dispatch;
mod egress;
mod lifecycle;
mod listener;
mod namespace;
mod producer_api;
mod producer_contract;
mod queue_conformance;
mod runtime;
pub(crate) mod stellar;
mod support;
mod tidy;
