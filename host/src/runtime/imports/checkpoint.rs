//! `checkpoint` and `fees`: what the host hands the attempt being
//! executed (where its receipt is saved, the fee it was priced at) and what
//! the attempt reports back (the fee it actually paid).

use super::super::bindings::executor::laneway::plugin::{checkpoint, fees};
use super::super::state::HostState;
use crate::executor::CheckpointError;

impl checkpoint::Host for HostState {
    async fn save(&mut self, receipt: String) -> wasmtime::Result<Result<(), checkpoint::Error>> {
        let Some(target) = self.checkpoint.clone() else {
            return Ok(Err(checkpoint::Error::Failed("no op is being executed".into())));
        };
        Ok(match target.checkpoint(&receipt).await {
            Ok(()) => Ok(()),
            Err(CheckpointError::LeaseLost) => Err(checkpoint::Error::LeaseLost),
            Err(CheckpointError::Queue(e)) => Err(checkpoint::Error::Failed(e.to_string())),
        })
    }
}

impl fees::Host for HostState {
    async fn current(&mut self) -> wasmtime::Result<Option<fees::Bid>> {
        Ok(self.fee.map(|b| fees::Bid {
            base_fee: b.base_fee,
            aggressive: b.aggressive,
            capped: b.capped,
        }))
    }

    async fn spent(&mut self, base_fee: u64) -> wasmtime::Result<()> {
        if let Some(spent) = &self.spent {
            spent.report(base_fee);
        }
        Ok(())
    }
}
