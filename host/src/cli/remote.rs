//! Remote mode: with `--url`, the operator commands (`ops`, `lanes`,
//! `subjects`, `pause`, `resume`, `pauses`, `audit`, `outcomes`) and the
//! producer's (`enqueue`, `fanout`) go to a running host's HTTP API instead
//! of the database, so an operator needs an API key, not database
//! credentials, and every write is audited under the key's name.
//!
//! The key comes from [`KEY_VAR`], outside the `LANEWAY_*` names (each of
//! which the config loader reads as a config key). Answers are printed as
//! the API's JSON, pretty unless `--json` asks for one line.

use std::io::Write;

use serde_json::{json, Value};

use super::{CliError, Command, EnqueueArgs, FanoutArgs, LanesCommand, OpsCommand, SubjectsCommand};

/// The variable remote mode reads the API key from.
pub const KEY_VAR: &str = "LW_API_KEY";

/// A request to make: method, path (with its query), body.
struct Call {
    method: reqwest::Method,
    path: String,
    body: Option<Value>,
    json: bool,
}

impl Call {
    fn get(path: String, json: bool) -> Self {
        Self {
            method: reqwest::Method::GET,
            path,
            body: None,
            json,
        }
    }

    fn post(path: String, body: Option<Value>, json: bool) -> Self {
        Self {
            method: reqwest::Method::POST,
            path,
            body,
            json,
        }
    }
}

/// Percent-encodes one path segment or query value.
fn enc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", enc(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

/// The JSON a command reads from a file or standard input.
fn document(source: &str, what: &str, stdin: &mut dyn std::io::Read) -> Result<Value, CliError> {
    let text = super::read_input(source, what, stdin)?;
    serde_json::from_str(&text).map_err(|e| CliError::Input(format!("the {what} is not JSON: {e}")))
}

/// `enqueue` as `POST /api/v1/ops`.
fn enqueue_call(a: EnqueueArgs, stdin: &mut dyn std::io::Read) -> Result<Call, CliError> {
    let payload = document(&a.payload, "payload", stdin)?;
    Ok(Call::post(
        "/api/v1/ops".to_owned(),
        Some(json!({
            "kind": a.kind, "outbox": a.outbox, "priority": a.priority, "lanes": a.lanes,
            "payload": payload, "idempotency_key": a.idempotency_key, "coalesce_key": a.coalesce_key,
            "subject": a.subject, "correlation_id": a.correlation_id, "delay_ms": a.delay_ms,
        })),
        a.json,
    ))
}

/// `fanout` as `POST /api/v1/activitypub/deliveries` (`INBOX=SHARED` read
/// as the local `fanout` reads it, sent as `{inbox, shared_inbox}`).
fn fanout_call(a: FanoutArgs, stdin: &mut dyn std::io::Read) -> Result<Call, CliError> {
    let activity = document(&a.activity, "activity", stdin)?;
    let recipients: Vec<Value> = a
        .recipients
        .iter()
        .map(|r| {
            let recipient = crate::fanout::Recipient::parse(r);
            json!({ "inbox": recipient.inbox, "shared_inbox": recipient.shared_inbox })
        })
        .collect();
    Ok(Call::post(
        "/api/v1/activitypub/deliveries".to_owned(),
        Some(json!({
            "kind": a.kind, "outbox": a.outbox, "activity": activity, "recipients": recipients,
            "priority": a.priority, "subject": a.subject,
        })),
        a.json,
    ))
}

/// The API call a command makes, or why it has none.
fn call_for(command: Command, stdin: &mut dyn std::io::Read) -> Result<Call, CliError> {
    Ok(match command {
        Command::Enqueue(a) => enqueue_call(a, stdin)?,
        Command::Fanout(a) => fanout_call(a, stdin)?,
        Command::Ops(OpsCommand::List(a)) => Call::get(
            format!(
                "/api/admin/outbox{}",
                query(&[
                    ("status", a.status),
                    ("kind", a.kind),
                    ("priority", a.priority),
                    ("subject", a.subject),
                    ("outbox", a.outbox),
                    ("lane", a.lane),
                    ("correlation_id", a.correlation),
                    ("after", a.after.map(|v| v.to_string())),
                    ("limit", Some(a.limit.to_string())),
                    ("order", a.newest.then(|| "desc".to_owned())),
                ])
            ),
            a.json,
        ),
        Command::Ops(OpsCommand::Show(a)) => Call::get(format!("/api/admin/outbox/{}", a.id), a.json),
        Command::Ops(OpsCommand::Retry(a)) => Call::post(format!("/api/admin/outbox/{}/retry", a.id), None, a.json),
        Command::Ops(OpsCommand::Cancel(a)) => Call::post(format!("/api/admin/outbox/{}/cancel", a.id), None, a.json),
        Command::Ops(OpsCommand::Stats(a)) => Call::get("/api/admin/outbox/stats".to_owned(), a.json),
        Command::Lanes(LanesCommand::List(a)) => {
            Call::get(format!("/api/admin/lanes{}", query(&[("outbox", a.outbox)])), a.json)
        }
        Command::Lanes(LanesCommand::Skip(a)) => Call::post(
            "/api/admin/lanes/skip".to_owned(),
            Some(json!({ "outbox": a.outbox, "lane": a.lane })),
            a.json,
        ),
        Command::Subjects(SubjectsCommand::Halt(a)) => Call::post(
            "/api/admin/subjects/halt".to_owned(),
            Some(json!({ "subject": a.subject, "reason": a.reason })),
            a.json,
        ),
        Command::Subjects(SubjectsCommand::Unhalt(a)) => Call::post(
            "/api/admin/subjects/unhalt".to_owned(),
            Some(json!({ "subject": a.subject })),
            a.json,
        ),
        Command::Subjects(SubjectsCommand::List(a)) => Call::get("/api/admin/subjects".to_owned(), a.json),
        Command::Pause(a) => Call::post(
            "/api/admin/pauses".to_owned(),
            Some(json!({ "scope": a.scope, "target": a.target, "reason": a.reason })),
            a.json,
        ),
        Command::Resume(a) => Call {
            method: reqwest::Method::DELETE,
            path: format!("/api/admin/pauses/{}/{}", enc(&a.scope), enc(&a.target)),
            body: None,
            json: a.json,
        },
        Command::Pauses(a) => Call::get("/api/admin/pauses".to_owned(), a.json),
        Command::Audit(a) => Call::get(
            format!(
                "/api/admin/audit{}",
                query(&[
                    ("before", a.before.map(|v| v.to_string())),
                    ("limit", Some(a.limit.to_string())),
                ])
            ),
            a.json,
        ),
        _ => {
            return Err(CliError::Input(
                "--url applies to enqueue, fanout, ops, lanes, subjects, pause, resume, pauses, audit and \
                 outcomes; other commands work on the database or the config"
                    .to_owned(),
            ))
        }
    })
}

/// Runs `command` against the API at `base`.
///
/// # Errors
///
/// [`CliError::Input`] for a command remote mode does not serve, a missing
/// key or an unreachable host; [`CliError::Remote`] for the API's refusal.
pub async fn run(
    base: &str,
    insecure: bool,
    command: Command,
    env: &[(String, String)],
    (stdin, out): (&mut dyn std::io::Read, &mut dyn Write),
) -> Result<(), CliError> {
    let api = Api::new(base, insecure, env)?;
    if let Command::Outcomes(args) = command {
        return outcomes(&api, args, out).await;
    }
    let call = call_for(command, stdin)?;
    let mut body = api.send(&call).await?;
    // Held lanes come a page at a time: every page, as the database lists them.
    if call.path.starts_with("/api/admin/lanes") && call.method == reqwest::Method::GET {
        let separator = if call.path.contains('?') { '&' } else { '?' };
        while let Some(next) = body["next"].as_str().map(str::to_owned) {
            let page = api
                .send(&Call::get(
                    format!("{}{separator}after={}", call.path, enc(&next)),
                    true,
                ))
                .await?;
            let mut held = body["held"].as_array().cloned().unwrap_or_default();
            held.extend(page["held"].as_array().cloned().unwrap_or_default());
            body = json!({ "held": held, "next": page["next"] });
        }
    }
    let printed = if call.json {
        body.to_string()
    } else {
        serde_json::to_string_pretty(&body).unwrap_or_else(|_| body.to_string())
    };
    writeln!(out, "{printed}")?;
    Ok(())
}

/// `outcomes` over the feed route: the same lines as against the database.
async fn outcomes(api: &Api, args: super::operator::OutcomesArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let filters = args.query();
    super::operator::follow_outcomes(args, out, async |after: Option<String>, limit: u32| {
        let mut params = vec![("after", after), ("limit", Some(limit.to_string()))];
        params.extend(filters.iter().cloned());
        let path = format!("/api/v1/outcomes{}", query(&params));
        let body = api.send(&Call::get(path, true)).await?;
        let entries = body["outcomes"].as_array().cloned().unwrap_or_default();
        Ok((entries, body["next"].as_str().map(str::to_owned)))
    })
    .await
}

/// The key goes only over https, or plain http to this machine, unless the
/// operator says `--insecure`.
fn check_base(base: &str, insecure: bool) -> Result<(), CliError> {
    let url = reqwest::Url::parse(base).map_err(|e| CliError::Input(format!("--url: {base:?} is not a URL: {e}")))?;
    match url.scheme() {
        "https" => Ok(()),
        "http" if insecure || is_loopback(&url) => Ok(()),
        "http" => Err(CliError::Input(format!(
            "--url: refusing to send the API key over plain http:// to {}, which is not this machine \
             (use https://, or --insecure to send it anyway)",
            url.host_str().unwrap_or_default()
        ))),
        _ => Err(CliError::Input(format!(
            "--url: expected http:// or https://, got {base:?}"
        ))),
    }
}

fn is_loopback(url: &reqwest::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        None => false,
    }
}

/// A host's API and the key to use with it.
struct Api {
    client: reqwest::Client,
    base: String,
    key: String,
}

impl Api {
    fn new(base: &str, insecure: bool, env: &[(String, String)]) -> Result<Self, CliError> {
        let key = env
            .iter()
            .find(|(k, _)| k == KEY_VAR)
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                CliError::Input(format!(
                    "--url needs an API key in {KEY_VAR} (see `laneway api-keys new`)"
                ))
            })?;
        let base = base.trim_end_matches('/').to_owned();
        check_base(&base, insecure)?;
        // No redirects: a redirect could carry the key somewhere the
        // operator did not name (or to plain http).
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(std::time::Duration::from_secs(60))
            .build()
            .map_err(|e| CliError::Input(format!("cannot build an HTTP client: {e}")))?;
        Ok(Self { client, base, key })
    }

    /// Makes the call; the answer's JSON, or the API's refusal.
    async fn send(&self, call: &Call) -> Result<Value, CliError> {
        let base = &self.base;
        let mut request = self
            .client
            .request(call.method.clone(), format!("{base}{}", call.path))
            .bearer_auth(&self.key);
        if let Some(body) = &call.body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_string());
        }
        let response = request
            .send()
            .await
            .map_err(|e| CliError::Input(format!("cannot reach {base}: {e}")))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| CliError::Input(format!("reading the answer from {base}: {e}")))?;
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let code = body["error"]["code"].as_str().unwrap_or("").to_owned();
            let message = body["error"]["message"]
                .as_str()
                .map_or_else(|| body.to_string(), str::to_owned);
            return Err(CliError::Remote {
                status: status.as_u16(),
                code,
                message,
            });
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_encoded_so_a_lane_url_survives_the_query() {
        assert_eq!(
            query(&[("lane", Some("https://a.example/u/x?y=1&z".to_owned())), ("kind", None)]),
            "?lane=https%3A%2F%2Fa.example%2Fu%2Fx%3Fy%3D1%26z"
        );
        assert_eq!(query(&[("kind", None)]), "");
        assert_eq!(enc("josé"), "jos%C3%A9");
    }

    #[test]
    fn a_remote_fanout_reads_recipients_as_the_local_one_does() {
        let args = FanoutArgs {
            kind: "activitypub".to_owned(),
            outbox: "o".to_owned(),
            recipients: vec![
                "https://a.example/inbox?token=abc=".to_owned(),
                "https://b.example/u/inbox=https://b.example/inbox".to_owned(),
            ],
            activity: "-".to_owned(),
            priority: None,
            subject: None,
            json: true,
        };
        let mut stdin: &[u8] = br#"{"id":"https://o.example/1"}"#;
        let call = fanout_call(args, &mut stdin).expect("a call");
        let body = call.body.expect("a body");
        assert_eq!(
            body["recipients"],
            json!([
                { "inbox": "https://a.example/inbox?token=abc=", "shared_inbox": null },
                { "inbox": "https://b.example/u/inbox", "shared_inbox": "https://b.example/inbox" },
            ])
        );
    }

    #[test]
    fn the_key_goes_over_plain_http_only_to_loopback_or_when_told() {
        for ok in [
            "https://laneway.example",
            "http://127.0.0.1:7480",
            "http://127.8.0.1",
            "http://[::1]:7480",
            "http://localhost:7480",
        ] {
            assert!(check_base(ok, false).is_ok(), "{ok}");
        }
        for refused in [
            "http://10.0.0.5:7480",
            "http://laneway.example",
            "http://localhost.evil.example",
        ] {
            let err = check_base(refused, false).unwrap_err().to_string();
            assert!(err.contains("--insecure"), "{refused}: {err}");
            assert!(check_base(refused, true).is_ok(), "{refused} with --insecure");
        }
        assert!(check_base("ftp://laneway.example", true).is_err());
        assert!(check_base("not a url", true).is_err());
    }
}
