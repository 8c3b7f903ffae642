//! `notes`: small per-destination-host notes a plugin keeps, shared by
//! every host through the queue's records, capped in size and number.

use super::super::bindings::executor::laneway::plugin::notes;
use super::super::state::HostState;

/// Longest note key and value, and most notes written per call: notes are
/// small facts about a server, not storage.
const NOTE_KEY_BYTES: usize = 128;
const NOTE_VALUE_BYTES: usize = 4096;
const NOTE_HOST_BYTES: usize = 300;
const NOTES_PER_CALL: u32 = 8;
/// The longest claim.
const MAX_CLAIM: std::time::Duration = std::time::Duration::from_secs(3600);

impl notes::Host for HostState {
    async fn get(&mut self, host: String, key: String) -> wasmtime::Result<Option<String>> {
        let Some(notes) = self.notes.clone() else {
            return Ok(None);
        };
        match notes.get(&self.services.plugin, &host, &key).await {
            Ok(value) => Ok(value),
            Err(e) => {
                // A note is a hint: without it the plugin does what it does
                // on first contact.
                tracing::warn!(plugin = %self.services.plugin, error = %e, "Could not read a plugin note.");
                Ok(None)
            }
        }
    }

    async fn set(&mut self, host: String, key: String, value: String) -> wasmtime::Result<Result<(), String>> {
        let Some(notes) = self.notes.clone() else {
            return Ok(Err("notes are kept only while an op is executed".into()));
        };
        if host.is_empty() || host.len() > NOTE_HOST_BYTES || key.is_empty() || key.len() > NOTE_KEY_BYTES {
            return Ok(Err(format!(
                "a note needs a host of 1 to {NOTE_HOST_BYTES} bytes and a key of 1 to {NOTE_KEY_BYTES} bytes"
            )));
        }
        if value.len() > NOTE_VALUE_BYTES {
            return Ok(Err(format!("a note's value is at most {NOTE_VALUE_BYTES} bytes")));
        }
        if self.notes_written >= NOTES_PER_CALL {
            return Ok(Err(format!("at most {NOTES_PER_CALL} notes are written per call")));
        }
        self.notes_written += 1;
        Ok(notes
            .set(&self.services.plugin, &host, &key, &value)
            .await
            .map_err(|e| e.to_string()))
    }

    async fn claim(&mut self, host: String, key: String, ttl_ms: u64) -> wasmtime::Result<bool> {
        let Some(notes) = self.notes.clone() else {
            return Ok(false);
        };
        if host.is_empty() || host.len() > NOTE_HOST_BYTES || key.is_empty() || key.len() > NOTE_KEY_BYTES {
            return Ok(false);
        }
        if self.notes_written >= NOTES_PER_CALL {
            return Ok(false);
        }
        self.notes_written += 1;
        let ttl = std::time::Duration::from_millis(ttl_ms).min(MAX_CLAIM);
        match notes.claim(&self.services.plugin, &host, &key, ttl).await {
            Ok(taken) => Ok(taken),
            Err(e) => {
                // Not taken: the plugin does what it does when another holds it.
                tracing::warn!(plugin = %self.services.plugin, error = %e, "Could not take a plugin claim.");
                Ok(false)
            }
        }
    }
}
