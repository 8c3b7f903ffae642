//! Checking a configuration that parses: values that make no sense,
//! references that lead nowhere (a kind's plugin, a webhook's key), URLs
//! outside an allow-list. Every problem is reported with its key path.

use std::collections::BTreeMap;

use super::*;

/// Checks values that parse but make no sense.
pub(super) fn validate(config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut bad = |path: &str, message: String| {
        problems.push(Problem {
            path: path.to_owned(),
            message,
        })
    };
    let url = &config.database.url;
    if crate::queue::Backend::from_url(url).is_none() {
        bad(
            "database.url",
            format!(
                "expected sqlite:FILE or postgres://…, got {:?}",
                crate::queue::redact_url(url)
            ),
        );
    }
    if config.database.max_connections == 0 {
        bad("database.max_connections", "expected at least 1".to_owned());
    }
    if config.database.connect_timeout_ms == 0 {
        bad("database.connect_timeout_ms", "expected at least 1".to_owned());
    }
    if !(1..=600_000).contains(&config.database.lock_timeout_ms) {
        bad(
            "database.lock_timeout_ms",
            format!(
                "expected 1 to 600000 (ten minutes), got {}",
                config.database.lock_timeout_ms
            ),
        );
    }
    if let Some(schema) = &config.database.schema {
        if let Err(why) = crate::queue::check_schema_name(schema) {
            bad("database.schema", why);
        }
    }
    const MAX_PAYLOAD: usize = 64 * 1024 * 1024;
    if !(1..=MAX_PAYLOAD).contains(&config.queue.max_payload_bytes) {
        bad(
            "queue.max_payload_bytes",
            format!("expected 1 to {MAX_PAYLOAD}, got {}", config.queue.max_payload_bytes),
        );
    }
    if config.queue.lease_ms < 1000 {
        bad(
            "queue.lease_ms",
            format!(
                "expected at least 1000 (a lease shorter than a second expires under load), got {}",
                config.queue.lease_ms
            ),
        );
    }
    if !(1..=10_000).contains(&config.queue.claim_batch) {
        bad(
            "queue.claim_batch",
            format!("expected 1 to 10000, got {}", config.queue.claim_batch),
        );
    }
    let d = &config.dispatch;
    let positive: [(&str, u64); 8] = [
        ("dispatch.poll_ms", d.poll_ms),
        ("dispatch.max_in_flight", d.max_in_flight as u64),
        ("dispatch.outbox_max_in_flight", d.outbox_max_in_flight as u64),
        ("dispatch.window", u64::from(d.window)),
        ("dispatch.in_pass_attempts", u64::from(d.in_pass_attempts)),
        ("dispatch.shutdown_grace_ms", d.shutdown_grace_ms),
        ("dispatch.breaker.threshold", u64::from(d.breaker.threshold)),
        ("dispatch.breaker.cool_off_ms", d.breaker.cool_off_ms),
    ];
    for (path, value) in positive {
        if value == 0 {
            bad(path, "expected at least 1".to_owned());
        }
    }
    if config.database.sqlite.watch_ms > 10_000 {
        bad(
            "database.sqlite.watch_ms",
            format!("expected 0 (off) to 10000, got {}", config.database.sqlite.watch_ms),
        );
    }
    if d.slot_ttl_ms < 1000 {
        bad(
            "dispatch.slot_ttl_ms",
            format!("expected at least 1000, got {}", d.slot_ttl_ms),
        );
    }
    let api = &config.api;
    if !api.listen.is_empty() && api.listen.parse::<std::net::SocketAddr>().is_err() {
        bad(
            "api.listen",
            format!(
                "expected HOST:PORT with an IP address (e.g. 127.0.0.1:7480) or \"\" for no API, got {:?}",
                api.listen
            ),
        );
    }
    for (path, value, max) in [
        ("api.max_body_bytes", api.max_body_bytes as u64, 64 * 1024 * 1024),
        ("api.max_page", u64::from(api.max_page), 10_000),
        ("api.recover_per_second", u64::from(api.recover_per_second), 100_000),
        ("api.public_per_second", u64::from(api.public_per_second), 100_000),
        ("api.header_timeout_ms", api.header_timeout_ms, 300_000),
        ("api.body_timeout_ms", api.body_timeout_ms, 3_600_000),
        ("api.max_connections", api.max_connections as u64, 1_000_000),
        (
            "api.max_connections_per_ip",
            api.max_connections_per_ip as u64,
            1_000_000,
        ),
        ("api.max_waiters", api.max_waiters as u64, 100_000),
    ] {
        if !(1..=max).contains(&value) {
            bad(path, format!("expected 1 to {max}, got {value}"));
        }
    }
    let r = &config.retention;
    // A retention shorter than the lease could prune an op whose outcome a
    // stalled dispatcher has yet to record.
    let lease = config.queue.lease_ms;
    let short = |value: u64| value != 0 && value < lease;
    for (path, value) in [
        ("retention.confirmed_ms", r.confirmed_ms),
        ("retention.cancelled_ms", r.cancelled_ms),
        ("retention.failed_ms", r.failed_ms),
        ("retention.idempotency_ms", r.idempotency_ms),
    ] {
        if short(value) {
            bad(
                path,
                format!("expected 0 (forever) or at least queue.lease_ms ({lease}), got {value}"),
            );
        }
    }
    for entry in &config.outcomes.allowed_hosts {
        if let Err(e) = crate::egress::HostPattern::parse(entry) {
            bad("outcomes.allowed_hosts", e);
        }
    }
    for entry in &config.outcomes.allowed_internal {
        if let Err(e) = crate::egress::Cidr::parse(entry) {
            bad("outcomes.allowed_internal", e);
        }
    }
    let d = &config.destinations;
    if d.probe_every_ms < 1000 {
        bad(
            "destinations.probe_every_ms",
            format!("expected at least 1000 (one probe a second), got {}", d.probe_every_ms),
        );
    }
    if d.unavailable_after_ms == 0 {
        bad(
            "destinations.unavailable_after_ms",
            "expected more than 0 (one failure would suspend a host)".to_owned(),
        );
    }
    if !(d.rate_per_second.is_finite() && d.rate_per_second >= 0.0) {
        bad(
            "destinations.rate_per_second",
            format!("expected 0 (unlimited) or a positive number, got {}", d.rate_per_second),
        );
    }
    if d.max_in_flight == 0 {
        bad("destinations.max_in_flight", "expected at least 1".to_owned());
    }
    if d.max_in_flight_unanswered == 0 || d.max_in_flight_unanswered > d.max_in_flight.max(1) {
        bad(
            "destinations.max_in_flight_unanswered",
            format!(
                "expected 1 to destinations.max_in_flight ({}), got {}",
                d.max_in_flight, d.max_in_flight_unanswered
            ),
        );
    }
    if d.unanswered_patience_ms == 0 {
        bad(
            "destinations.unanswered_patience_ms",
            "expected at least 1 (to give every destination the full cap at once, set max_in_flight_unanswered = max_in_flight)".to_owned(),
        );
    }
    if !(100..=3_600_000).contains(&d.health_refresh_ms) {
        bad(
            "destinations.health_refresh_ms",
            format!("expected 100 to 3600000, got {}", d.health_refresh_ms),
        );
    }
    if d.forget_after_ms < 3_600_000 {
        bad(
            "destinations.forget_after_ms",
            format!(
                "expected at least 3600000 (an hour: a host held unavailable must be remembered longer than its probes), got {}",
                d.forget_after_ms
            ),
        );
    }
    if d.rate_burst == 0 {
        bad("destinations.rate_burst", "expected at least 1".to_owned());
    }
    let inbound = &config.inbound;
    for entry in &inbound.allowed_hosts {
        if let Err(e) = crate::egress::HostPattern::parse(entry) {
            bad("inbound.allowed_hosts", e);
        }
    }
    for entry in &inbound.allowed_internal {
        if let Err(e) = crate::egress::Cidr::parse(entry) {
            bad("inbound.allowed_internal", e);
        }
    }
    // A refetch on every bad signature would let anyone make laneway fetch
    // a key as often as they send requests.
    if !(1000..=86_400_000).contains(&inbound.key_refetch_ms) {
        bad(
            "inbound.key_refetch_ms",
            format!("expected 1000 to 86400000, got {}", inbound.key_refetch_ms),
        );
    }
    for (path, message) in super::fetch_actor_problems(config) {
        bad(&path, message);
    }
    if !(1000..=86_400_000).contains(&inbound.key_failure_ms) {
        bad(
            "inbound.key_failure_ms",
            format!("expected 1000 to 86400000, got {}", inbound.key_failure_ms),
        );
    }
    if !inbound.public_url.is_empty()
        && !reqwest::Url::parse(&inbound.public_url).is_ok_and(|u| matches!(u.scheme(), "http" | "https"))
    {
        bad(
            "inbound.public_url",
            format!("expected an http(s) URL or empty, got {:?}", inbound.public_url),
        );
    }
    if inbound.enabled {
        match config.kinds.get(&inbound.kind) {
            None => bad(
                "inbound.kind",
                format!("{:?} is not a configured kind ([kinds.{}])", inbound.kind, inbound.kind),
            ),
            Some(kind) if kind.plugin.is_none() => bad(
                &format!("kinds.{}.plugin", inbound.kind),
                "inbound activities need a handler plugin (the shipped `webhook`, for one)".to_owned(),
            ),
            Some(_) => {}
        }
        if config.api.listen.is_empty() {
            bad(
                "inbound.enabled",
                "the inboxes are served on the API listener, but api.listen is empty".to_owned(),
            );
        }
    }
    if config.outcomes.relay_every_ms < 10 {
        bad(
            "outcomes.relay_every_ms",
            format!("expected at least 10, got {}", config.outcomes.relay_every_ms),
        );
    }
    if r.every_ms < 100 {
        bad(
            "retention.every_ms",
            format!("expected at least 100, got {}", r.every_ms),
        );
    }
    if !(1..=10_000).contains(&r.batch) {
        bad("retention.batch", format!("expected 1 to 10000, got {}", r.batch));
    }
    for (name, kind) in &config.kinds {
        let path = |key: &str| format!("kinds.{name}.{key}");
        for (key, value) in [
            ("retention_confirmed_ms", kind.retention_confirmed_ms),
            ("retention_cancelled_ms", kind.retention_cancelled_ms),
            ("retention_failed_ms", kind.retention_failed_ms),
            ("idempotency_retention_ms", kind.idempotency_retention_ms),
        ] {
            if let Some(value) = value.filter(|v| short(*v)) {
                bad(
                    &path(key),
                    format!("expected 0 (forever) or at least queue.lease_ms ({lease}), got {value}"),
                );
            }
        }
        match (&kind.outcome_webhook, &kind.outcome_webhook_key) {
            (Some(url), key) => {
                if let Some(why) = webhook_url_refused(url, &config.outcomes) {
                    bad(&path("outcome_webhook"), why);
                }
                match key.as_ref().map(|k| (k, config.keys.get(k))) {
                    None => bad(
                        &path("outcome_webhook_key"),
                        "expected the [keys.ID] that signs this kind's webhooks".to_owned(),
                    ),
                    Some((k, None)) => bad(&path("outcome_webhook_key"), format!("no [keys.{k}] is configured")),
                    Some((k, Some(source))) if source.algorithm != crate::keys::Algorithm::HmacSha256 => bad(
                        &path("outcome_webhook_key"),
                        format!("[keys.{k}] is {}, expected hmac-sha256", source.algorithm),
                    ),
                    Some(_) => {}
                }
                if name == WEBHOOK_KIND {
                    bad(
                        &path("outcome_webhook"),
                        "the webhook kind's own outcomes are not sent on".to_owned(),
                    );
                }
            }
            (None, Some(_)) => bad(&path("outcome_webhook_key"), "set only with outcome_webhook".to_owned()),
            (None, None) => {}
        }
        if name == WEBHOOK_KIND && kind.plugin.is_some() {
            bad(&path("plugin"), "laneway delivers this kind itself".to_owned());
        }
        if let Some(dir) = &kind.archive {
            let at = std::path::Path::new(dir);
            if dir.trim().is_empty() {
                bad(&path("archive"), "expected a directory path".to_owned());
            } else if at.exists() && !at.is_dir() {
                bad(&path("archive"), format!("{dir:?} exists and is not a directory"));
            }
        }
        if kind.lane_cap == 0 {
            bad(&path("lane_cap"), "expected at least 1".to_owned());
        }
        if kind.max_in_flight == Some(0) {
            bad(
                &path("max_in_flight"),
                "expected at least 1 (leave it out for no cap)".to_owned(),
            );
        }
        if kind.max_attempts == 0 {
            bad(&path("max_attempts"), "expected at least 1".to_owned());
        }
        if kind.fault_attempts == 0 {
            bad(&path("fault_attempts"), "expected at least 1".to_owned());
        }
        if kind.timeout_ms == 0 {
            bad(&path("timeout_ms"), "expected at least 1".to_owned());
        }
        // One at or past `timeout_ms` is allowed: never reached, as when
        // left out (a test's short timeout under the shipped 1 s).
        if kind.slow_after_ms == Some(0) {
            bad(
                &path("slow_after_ms"),
                "expected at least 1 (leave it out for never)".to_owned(),
            );
        }
        if kind.backoff_base_ms > kind.backoff_max_ms {
            bad(
                &path("backoff_base_ms"),
                format!(
                    "expected at most backoff_max_ms ({}), got {}",
                    kind.backoff_max_ms, kind.backoff_base_ms
                ),
            );
        }
        if kind.poison == Poison::Halt && kind.lane_mode == LaneMode::Serial {
            bad(
                &path("poison"),
                "\"halt\" applies to strict lanes; this kind's lanes are serial".to_owned(),
            );
        }
    }
    let r = &config.runtime;
    // Every attempt in flight, slow ones included, runs in an instance of
    // its own; with fewer, deliveries wait for instances behind the very
    // hung requests slow attempts are there to step around.
    let dispatch = &config.dispatch;
    let in_flight = dispatch.max_in_flight.saturating_add(dispatch.max_slow);
    if usize::try_from(r.max_instances).is_ok_and(|n| n < in_flight) {
        bad(
            "runtime.max_instances",
            format!(
                "expected at least dispatch.max_in_flight + dispatch.max_slow ({} + {} = {in_flight}), got {}",
                dispatch.max_in_flight, dispatch.max_slow, r.max_instances
            ),
        );
    }
    for (path, value) in [
        ("runtime.max_instances", u64::from(r.max_instances)),
        ("runtime.epoch_tick_ms", r.epoch_tick_ms),
        ("runtime.quarantine_after", u64::from(r.quarantine_after)),
    ] {
        if value == 0 {
            bad(path, "expected at least 1".to_owned());
        }
    }
    if !(64..=8192).contains(&r.max_wasm_stack_kib) {
        bad(
            "runtime.max_wasm_stack_kib",
            format!("expected 64 to 8192, got {}", r.max_wasm_stack_kib),
        );
    }
    for (name, plugin) in &config.plugins {
        let path = |key: &str| format!("plugins.{name}.{key}");
        if !(1..=4096).contains(&plugin.memory_mib) {
            bad(
                &path("memory_mib"),
                format!("expected 1 to 4096, got {}", plugin.memory_mib),
            );
        }
        if !(1..=100).contains(&plugin.cpu_share_percent) {
            bad(
                &path("cpu_share_percent"),
                format!("expected 1 to 100, got {}", plugin.cpu_share_percent),
            );
        }
        for (key, value) in [
            ("timeout_ms", plugin.timeout_ms),
            ("fuel", plugin.fuel),
            ("connect_timeout_ms", plugin.connect_timeout_ms),
            ("request_timeout_ms", plugin.request_timeout_ms),
            ("max_response_bytes", plugin.max_response_bytes),
            ("max_connections", u64::from(plugin.max_connections)),
        ] {
            if value == 0 {
                bad(&path(key), "expected at least 1".to_owned());
            }
        }
        for entry in &plugin.allowed_hosts {
            if let Err(e) = crate::egress::HostPattern::parse(entry) {
                bad(&path("allowed_hosts"), e);
            }
        }
        for entry in &plugin.allowed_internal {
            if let Err(e) = crate::egress::Cidr::parse(entry) {
                bad(&path("allowed_internal"), e);
            }
        }
        for key in &plugin.keys {
            if !config.keys.contains_key(key) {
                bad(&path("keys"), format!("no [keys.{key}] is configured"));
            }
        }
    }
    for (id, key) in &config.keys {
        if key.file.is_some() == key.env.is_some() {
            bad(
                &format!("keys.{id}"),
                "give exactly one of `file` or `env` (never the key itself)".to_owned(),
            );
        }
    }
    for (name, oracle) in &config.oracles {
        let path = |key: &str| format!("oracles.{name}.{key}");
        if !config.plugins.contains_key(&oracle.policy) {
            bad(&path("policy"), format!("no [plugins.{}] is configured", oracle.policy));
        }
        if !(oracle.rpc_url.starts_with("https://") || oracle.rpc_url.starts_with("http://")) {
            bad(
                &path("rpc_url"),
                format!("expected an http(s) URL, got {:?}", oracle.rpc_url),
            );
        }
        if oracle.poll_ms < 100 {
            bad(
                &path("poll_ms"),
                format!("expected at least 100, got {}", oracle.poll_ms),
            );
        }
        if oracle.timeout_ms == 0 {
            bad(&path("timeout_ms"), "expected at least 1".to_owned());
        }
    }
    for (name, kind) in &config.kinds {
        if let Some(plugin) = &kind.plugin {
            if !config.plugins.contains_key(plugin) {
                bad(
                    &format!("kinds.{name}.plugin"),
                    format!("no [plugins.{plugin}] is configured"),
                );
            }
        }
        if let Some(oracle) = &kind.fee_oracle {
            if !config.oracles.contains_key(oracle) {
                bad(
                    &format!("kinds.{name}.fee_oracle"),
                    format!("no [oracles.{oracle}] is configured"),
                );
            }
        }
    }
    pools(config, &mut bad);
    for name in config.kinds.keys() {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            bad(
                &format!("kinds.{name}"),
                "kind names are letters, digits, '_' and '-'".to_owned(),
            );
        }
    }
    problems
}

/// Channel-account pools: every channel and the funder a configured
/// ed25519 key, no account both a channel and something else, and the
/// kinds that draw from one pool alike in plugin and signer (a pool's
/// channels carry one signer's contract calls).
fn pools(config: &Config, bad: &mut impl FnMut(&str, String)) {
    let ed25519 = |id: &str| -> Result<(), String> {
        match config.keys.get(id) {
            None => Err(format!("no [keys.{id}] is configured")),
            Some(k) if k.algorithm != crate::keys::Algorithm::Ed25519 => {
                Err(format!("[keys.{id}] is {}, expected ed25519", k.algorithm))
            }
            Some(_) => Ok(()),
        }
    };
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, pool) in &config.pools {
        let path = |key: &str| format!("pools.{name}.{key}");
        if pool.channels.is_empty() {
            bad(&path("channels"), "expected at least one channel key id".to_owned());
        }
        for id in &pool.channels {
            if let Err(e) = ed25519(id) {
                bad(&path("channels"), e);
            }
            if let Some(other) = owner.insert(id, name) {
                bad(
                    &path("channels"),
                    format!("channel {id:?} is listed twice (in pools.{other} too)"),
                );
            }
        }
        for id in &pool.retired {
            if !pool.channels.contains(id) {
                bad(
                    &path("retired"),
                    format!(
                        "{id:?} is not one of the pool's channels (a retired channel stays listed until it drains)"
                    ),
                );
            }
        }
        if !pool.channels.is_empty() && pool.channels.iter().all(|c| pool.retired.contains(c)) {
            bad(
                &path("retired"),
                "every channel is retired: the pool could take no op".to_owned(),
            );
        }
        if let Some(funder) = &pool.funder {
            if let Err(e) = ed25519(funder) {
                bad(&path("funder"), e);
            } else if pool.channels.contains(funder) {
                bad(&path("funder"), format!("{funder:?} is one of the pool's own channels"));
            }
        }
        if let Some(url) = &pool.rpc_url {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                bad(&path("rpc_url"), format!("expected an http(s) URL, got {url:?}"));
            } else if oracle_url_unlisted(url, &config.plugins).is_some() {
                bad(
                    &path("rpc_url"),
                    format!("{url} is in no plugin's allowed_hosts; list it on the plugin whose kinds use this pool"),
                );
            }
        }
    }
    let mut users: BTreeMap<&str, (&str, Option<&str>, Option<&str>)> = BTreeMap::new();
    for (kind_name, kind) in &config.kinds {
        let Some(pool_name) = &kind.pool else { continue };
        let path = format!("kinds.{kind_name}.pool");
        let Some(pool) = config.pools.get(pool_name) else {
            bad(&path, format!("no [pools.{pool_name}] is configured"));
            continue;
        };
        let signer = kind.config.get("signer_key").and_then(toml::Value::as_str);
        let plugin = kind.plugin.as_deref();
        if kind.lanes != LanePresence::Plugin {
            bad(
                &format!("kinds.{kind_name}.lanes"),
                "expected \"plugin\": a pool's kind takes its lanes from the pool, never from a producer".to_owned(),
            );
        }
        if kind.lane_cap != 1 {
            bad(
                &format!("kinds.{kind_name}.lane_cap"),
                format!(
                    "expected 1 (one transaction in flight per channel), got {}",
                    kind.lane_cap
                ),
            );
        }
        if let Some(signer) = signer.filter(|s| pool.channels.iter().any(|c| c == s)) {
            bad(
                &path,
                format!("the kind's signer_key {signer:?} is one of the pool's channels; a channel only carries transactions"),
            );
        }
        if let Some(plugin_name) = plugin {
            if let Some(granted) = config.plugins.get(plugin_name) {
                let missing: Vec<&str> = pool
                    .channels
                    .iter()
                    .filter(|c| !granted.keys.contains(c))
                    .map(String::as_str)
                    .collect();
                if !missing.is_empty() {
                    bad(
                        &path,
                        format!(
                            "plugins.{plugin_name}.keys must grant the pool's channels to sign with; missing {}",
                            missing.join(", ")
                        ),
                    );
                }
            }
        }
        match users.get(pool_name.as_str()) {
            Some((first, other_plugin, other_signer)) if (*other_plugin, *other_signer) != (plugin, signer) => bad(
                &path,
                format!(
                    "pool {pool_name:?} is shared with kinds.{first}, whose plugin or signer_key differs; a pool carries \
                     one signer's calls"
                ),
            ),
            Some(_) => {}
            None => {
                users.insert(pool_name, (kind_name, plugin, signer));
            }
        }
    }
}

/// Why a webhook URL cannot be used, if it cannot: the egress guard's own
/// judgement (scheme, allow-list, an internal IP literal in any spelling);
/// a name is judged again on what it resolves to when the webhook is sent.
/// Entries that do not parse are left out here: each is reported on its key.
fn webhook_url_refused(url: &str, outcomes: &super::OutcomesConfig) -> Option<String> {
    let policy = crate::egress::Egress::lenient("outcomes", &outcomes.allowed_hosts, &outcomes.allowed_internal);
    policy.check(url).err().map(|refusal| match refusal {
        crate::egress::Refusal::Malformed(_) | crate::egress::Refusal::Scheme(_) => {
            format!("expected an http(s) URL with a host, got {url:?}")
        }
        other => other.to_string(),
    })
}

/// The egress policy the fee oracle polls `rpc_url` with: the allow-lists
/// and internal allowances of the plugins that list it (the oracle prices
/// their kinds, so it may reach what they may).
pub fn oracle_egress(name: &str, rpc_url: &str, plugins: &BTreeMap<String, PluginConfig>) -> crate::egress::Egress {
    rpc_egress(&format!("oracles.{name}"), rpc_url, plugins)
}

/// The egress policy the host itself reaches a Stellar RPC with (a fee
/// oracle, `laneway stellar channels`): the allow-lists and internal
/// allowances of the plugins that list it.
pub fn rpc_egress(section: &str, rpc_url: &str, plugins: &BTreeMap<String, PluginConfig>) -> crate::egress::Egress {
    let section = format!("{section} (through the plugins listing its rpc_url)");
    let mut policy = crate::egress::Egress::lenient(&section, &[], &[]);
    let Ok(url) = reqwest::Url::parse(rpc_url) else {
        return policy;
    };
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return policy;
    };
    for plugin in plugins.values() {
        if crate::egress::listed(&plugin.allowed_hosts, url.scheme(), host, port) {
            let theirs = crate::egress::Egress::lenient(&section, &plugin.allowed_hosts, &plugin.allowed_internal);
            policy.allowed.extend(theirs.allowed);
            policy.allowed_internal.extend(theirs.allowed_internal);
        }
    }
    policy
}

/// Why an oracle's RPC URL is suspect: the host polls it itself, but the
/// chain kinds it prices reach their RPC through a plugin's allow-list, so an
/// oracle URL that no plugin may reach is a typo or another network's node,
/// and its quotes would price the wrong network. Checked where plugins are
/// loaded, so it is reported together with the kinds' own problems.
pub fn oracle_url_unlisted(rpc_url: &str, plugins: &BTreeMap<String, PluginConfig>) -> Option<String> {
    let url = reqwest::Url::parse(rpc_url).ok()?;
    let (host, port) = (url.host_str()?, url.port_or_known_default()?);
    let listed = plugins
        .values()
        .any(|p| crate::egress::listed(&p.allowed_hosts, url.scheme(), host, port));
    (!listed).then(|| {
        format!(
            "{}://{host}:{port} is in no plugin's allowed_hosts; list it on the executor plugin whose kinds this \
             oracle prices (an oracle polling another network quotes the wrong fees)",
            url.scheme()
        )
    })
}
