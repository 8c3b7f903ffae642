//! A laneway executor written from scratch with the SDK (the example of
//! `docs/plugin-authors.md`): it POSTs each op's payload to the kind's
//! `url` as a Standard Webhook (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature: v1,<HMAC-SHA256>`), signed by the host with an
//! `hmac-sha256` key the plugin never sees (WIT `mac`). A 2xx is a
//! delivery; 408, 429 and 5xx retry; any other 4xx dead-letters.
//!
//! laneway ships it as the handler of inbound ActivityPub activities
//! (`[kinds.activitypub_inbound]`), whose payload is the verified activity
//! with its sender and recipient; any other kind may use it as well.
//!
//! Drop it into a running laneway by editing the config:
//!
//! ```toml
//! [keys.hooks]
//! algorithm = "hmac-sha256"
//! file = "/etc/laneway/hooks.secret"    # whsec_…
//!
//! [plugins.webhook]
//! path = "plugins/target/wasm32-wasip2/release/webhook.wasm"
//! allowed_hosts = ["https://hooks.example.com"]
//! keys = ["hooks"]
//!
//! [kinds.hook]
//! plugin = "webhook"
//! config = { url = "https://hooks.example.com/laneway", key = "hooks" }
//! ```

use std::time::SystemTime;

use base64::Engine as _;
use laneway_sdk::http::{self, Request};
use laneway_sdk::{mac, Confirmation, Executor, Failure, Op, Outcome, Retry};
use serde::Deserialize;

/// The kind's `config` table.
#[derive(Debug, Deserialize)]
struct Config {
    /// The application's endpoint.
    url: String,
    /// The host's `hmac-sha256` key id (`[keys.ID]`, `whsec_…`).
    key: String,
}

const KEYS: [&str; 2] = ["url", "key"];

struct Webhook;

fn validate(config: &str) -> Result<(), Vec<laneway_sdk::Problem>> {
    use laneway_sdk::check::{self, ConfigCheck};
    let value = check::parse(config)?;
    let mut check = ConfigCheck::new();
    let Some(table) = check.table("", &value, &KEYS) else {
        return check.finish();
    };
    if let Some(url) = check.string("", table, "url", true) {
        check::reachable(&mut check, "url", url);
    }
    if let Some(key) = check.string("", table, "key", true) {
        match mac::hmac_sha256(key, b"") {
            Ok(_) => {}
            Err(laneway_sdk::signer::Error::Denied(_)) => check.problem(
                "key",
                format!("key {key:?} is not granted to this plugin (add it to the plugin's `keys`)"),
            ),
            Err(laneway_sdk::signer::Error::UnknownKey(_)) => check.problem("key", format!("no key {key:?} is loaded")),
            Err(e) => check.problem("key", format!("key {key:?} cannot sign HMAC-SHA256: {e:?}")),
        }
    }
    check.finish()
}

fn retry(reason: String, detail: Option<String>) -> Outcome {
    Outcome::Retryable(Retry {
        reason,
        retry_after_ms: None,
        detail,
        fee_bump: false,
    })
}

impl Executor for Webhook {
    fn describe() -> laneway_sdk::Description {
        laneway_sdk::describe("webhook", env!("CARGO_PKG_VERSION"), &["activitypub_inbound", "hook"])
    }

    fn validate_config(_kind: String, config: String) -> Result<(), Vec<laneway_sdk::Problem>> {
        validate(&config)
    }

    fn execute(op: Op) -> Outcome {
        let config: Config = match serde_json::from_str(&op.config) {
            Ok(c) => c,
            Err(e) => return laneway_sdk::permanent(format!("bad kind config: {e}")),
        };
        // The same id on every attempt, so the application can de-duplicate.
        let id = format!("lw-{}", op.id);
        let timestamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default()
            .to_string();
        let body = op.payload.into_bytes();
        let mut signed = format!("{id}.{timestamp}.").into_bytes();
        signed.extend_from_slice(&body);
        let mac = match mac::hmac_sha256(&config.key, &signed) {
            Ok(m) => m,
            Err(e) => return laneway_sdk::permanent(format!("cannot sign with key {:?}: {e:?}", config.key)),
        };
        let signature = format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac));
        let request = Request {
            method: "POST".into(),
            url: config.url,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("webhook-id".into(), id),
                ("webhook-timestamp".into(), timestamp),
                ("webhook-signature".into(), signature),
            ],
            body,
        };
        match http::send(&request) {
            Ok(response) => {
                let status = response.status;
                let detail = Some(status.to_string());
                match status {
                    200..=299 => Outcome::Confirmed(Confirmation { receipt: None, detail }),
                    408 | 429 | 500..=599 => retry(format!("HTTP {status}"), detail),
                    _ => Outcome::Permanent(Failure {
                        reason: format!("HTTP {status}"),
                        detail,
                    }),
                }
            }
            Err(http::Error::Denied(why)) => laneway_sdk::permanent(format!("destination refused by the host: {why}")),
            Err(e) => retry(format!("{e:?}"), None),
        }
    }
}

laneway_sdk::executor!(Webhook);
