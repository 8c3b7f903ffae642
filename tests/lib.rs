//! Support crate for the `it` integration-test binary; the tests live in `it/`.
#![forbid(unsafe_code)]
