//! The host side of the plugin imports, one module per import (as Spin
//! does): `http`, `signer` and `mac`, `log`, `checkpoint` and `fees`,
//! `notes`. Each enforces the plugin's grants before doing anything, on the
//! one per-call state (`HostState`).

mod checkpoint;
mod http;
mod log;
mod notes;
mod signer;

use super::bindings::executor::laneway::plugin::types;
use super::state::HostState;

impl types::Host for HostState {}
