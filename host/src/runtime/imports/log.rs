//! `log`: a plugin's structured log lines, truncated and capped per call.

use super::super::bindings::executor::laneway::plugin::log;
use super::super::state::HostState;

/// Longest log message kept.
const LOG_MESSAGE_BYTES: usize = 1024;
/// Most fields per log line, and longest field value.
const LOG_FIELDS: usize = 16;
const LOG_FIELD_BYTES: usize = 256;

fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl log::Host for HostState {
    async fn log(&mut self, level: log::Level, message: String, fields: Vec<(String, String)>) -> wasmtime::Result<()> {
        self.log_lines += 1;
        let limit = self.services.log_lines_per_call;
        if self.log_lines > limit {
            if self.log_lines == limit + 1 {
                tracing::warn!(plugin = %self.services.plugin, op = ?self.op_id, "Plugin log limit reached; further lines of this call are dropped.");
            }
            return Ok(());
        }
        let message = cut(&message, LOG_MESSAGE_BYTES);
        let fields: Vec<String> = fields
            .iter()
            .take(LOG_FIELDS)
            .map(|(k, v)| format!("{}={}", cut(k, 64), cut(v, LOG_FIELD_BYTES)))
            .collect();
        let fields = fields.join(" ");
        let plugin = self.services.plugin.as_str();
        let op = self.op_id;
        match level {
            log::Level::Trace => tracing::trace!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Debug => tracing::debug!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Info => tracing::info!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Warn => tracing::warn!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Error => tracing::error!(target: "laneway::plugin", plugin, op, fields, "{message}"),
        }
        Ok(())
    }
}
