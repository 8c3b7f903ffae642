//! `signer` and `mac`: signatures and MACs with keys the host holds,
//! granted per plugin by key id; no call returns key material.

use super::super::bindings::executor::laneway::plugin::{mac, signer};
use super::super::state::HostState;
use crate::keys::{Algorithm, SignError};

impl signer::Host for HostState {
    async fn sign(
        &mut self,
        key_id: String,
        algorithm: signer::Algorithm,
        data: Vec<u8>,
    ) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        let algorithm = match algorithm {
            signer::Algorithm::Ed25519 => Algorithm::Ed25519,
            signer::Algorithm::RsaSha256 => Algorithm::RsaSha256,
        };
        Ok(self.services.keys.sign(&key_id, algorithm, &data).map_err(sign_error))
    }

    async fn public_key(&mut self, key_id: String) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        Ok(self.services.keys.public_key(&key_id).map_err(sign_error))
    }
}

fn sign_error(e: SignError) -> signer::Error {
    match e {
        SignError::UnknownKey(k) => signer::Error::UnknownKey(k),
        e @ SignError::WrongAlgorithm { .. } => signer::Error::WrongAlgorithm(e.to_string()),
        SignError::Failed(s) => signer::Error::Failed(s),
    }
}

impl mac::Host for HostState {
    async fn hmac_sha256(&mut self, key_id: String, data: Vec<u8>) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        Ok(self
            .services
            .keys
            .sign(&key_id, Algorithm::HmacSha256, &data)
            .map_err(sign_error))
    }
}
