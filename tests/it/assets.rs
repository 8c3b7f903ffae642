//! The shipped alerting assets (`config/prometheus-alerts.yml`,
//! `config/grafana/laneway-dashboard.json`) parse, are complete, and name
//! only metrics laneway exports, so a renamed metric cannot leave an alert
//! that never fires.

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{ensure, Context};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The names `/metrics` exports: each family's `# TYPE` name.
fn exported() -> BTreeSet<String> {
    laneway::events::Metrics::new()
        .render()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The laneway metric names an expression uses, as families (a counter's
/// `_total`, a histogram's `_bucket`/`_sum`/`_count` stripped).
fn used(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
            continue;
        }
        if ["outbox_", "fee_oracle_", "plugin_"]
            .iter()
            .any(|p| word.starts_with(p))
        {
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(&word);
            names.push(family.to_owned());
        }
        word.clear();
    }
    names
}

#[test]
fn the_alert_rules_parse_and_name_only_exported_metrics() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(repo().join("config/prometheus-alerts.yml"))?;
    let doc: Value = serde_norway::from_str(&text).context("config/prometheus-alerts.yml is not YAML")?;
    let exported = exported();
    let rules: Vec<&Value> = doc["groups"]
        .as_array()
        .context("groups")?
        .iter()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    let mut alerts = BTreeSet::new();
    let mut metrics = BTreeSet::new();
    for rule in &rules {
        let name = rule["alert"].as_str().context("every rule is an alert")?;
        ensure!(alerts.insert(name.to_owned()), "{name} twice");
        let expr = rule["expr"].as_str().with_context(|| format!("{name}: expr"))?;
        ensure!(
            matches!(rule["labels"]["severity"].as_str(), Some("critical" | "warning")),
            "{name}: severity"
        );
        ensure!(rule["annotations"]["summary"].is_string(), "{name}: summary");
        if let Some(duration) = rule.get("for") {
            let d = duration.as_str().context("for is a duration")?;
            ensure!(
                d.len() > 1 && d[..d.len() - 1].parse::<u32>().is_ok() && d.ends_with(['s', 'm', 'h']),
                "{name}: for {d:?}"
            );
        }
        ensure!(
            expr.matches('(').count() == expr.matches(')').count(),
            "{name}: unbalanced {expr}"
        );
        for metric in used(expr) {
            ensure!(
                exported.contains(&metric),
                "{name} uses {metric}, which laneway does not export"
            );
            metrics.insert(metric);
        }
    }
    // What issue 12 asks the rules to cover.
    for want in [
        "fee_oracle_staleness_seconds",
        "fee_oracle_congestion_level",
        "outbox_stuck_submitted",
        "outbox_dead_letters",
        "plugin_quarantined",
        "plugin_reloads",
        "outbox_breakers_open",
        "outbox_oldest_due_age_seconds",
    ] {
        ensure!(metrics.contains(want), "no alert on {want}");
    }
    Ok(())
}

#[test]
fn the_dashboard_parses_and_charts_only_exported_metrics() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(repo().join("config/grafana/laneway-dashboard.json"))?;
    let doc: Value = serde_json::from_str(&text).context("the dashboard is not JSON")?;
    ensure!(doc["title"].is_string() && doc["uid"].is_string());
    let exported = exported();
    let panels = doc["panels"].as_array().context("panels")?;
    ensure!(!panels.is_empty());
    let mut ids = BTreeSet::new();
    let mut charted = BTreeSet::new();
    for panel in panels {
        ensure!(
            ids.insert(panel["id"].as_i64().context("panel id")?),
            "duplicate panel id"
        );
        let title = panel["title"].as_str().context("panel title")?;
        ensure!(panel["gridPos"]["w"].as_i64().is_some(), "{title}: gridPos");
        let targets = panel["targets"].as_array().context("targets")?;
        ensure!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().with_context(|| format!("{title}: expr"))?;
            for metric in used(expr) {
                ensure!(
                    exported.contains(&metric),
                    "{title} charts {metric}, which laneway does not export"
                );
                charted.insert(metric);
            }
        }
    }
    // Seed 003's metrics each have a chart.
    for name in [
        "outbox_ops",
        "outbox_queue_depth",
        "outbox_op_latency_seconds",
        "outbox_fee_bump",
        "outbox_stuck_submitted",
        "fee_oracle_recommended_base_fee",
        "fee_oracle_aggressive_base_fee",
        "fee_oracle_ledger_capacity_usage",
        "fee_oracle_congestion_level",
        "fee_oracle_staleness_seconds",
        "fee_oracle_clamp",
        "outbox_low_deferred",
        "outbox_aggressive_fee_used",
        "outbox_max_fee_hit",
    ] {
        ensure!(charted.contains(name), "no panel charts {name}");
    }
    Ok(())
}

#[test]
fn the_metric_name_scanner_finds_families() {
    assert_eq!(
        used("histogram_quantile(0.5, sum by (le) (rate(outbox_op_latency_seconds_bucket[5m]))) + outbox_ops_total"),
        ["outbox_op_latency_seconds", "outbox_ops"]
    );
    assert!(used("up{job=\"laneway\"} == 0").is_empty());
}
