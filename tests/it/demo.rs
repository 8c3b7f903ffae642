//! `laneway demo --short` as a newcomer runs it (the shipped
//! `config/demo.toml`, the real plugins), read back from its report: every
//! lane in order, the gone inbox's ops dead-lettered and explained, a
//! withdrawal overtaking the backlog at a higher fee, and the printed CLI
//! line for the dead letter working as printed.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{ensure, Context};

use crate::api::cli;

/// One row of a report table: its cells, trimmed.
fn rows<'a>(report: &'a str, first: &str) -> anyhow::Result<HashMap<String, Vec<&'a str>>> {
    let mut found = HashMap::new();
    let table = report
        .split("\n\n")
        .find(|block| block.starts_with(first))
        .with_context(|| format!("no {first} table in:\n{report}"))?;
    for line in table.lines().filter(|l| l.starts_with('│')) {
        let cells: Vec<&str> = line.trim_matches('│').split('┆').map(str::trim).collect();
        found.insert(cells[0].to_owned(), cells);
    }
    Ok(found)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_short_demo_reports_ordered_lanes_and_an_explained_dead_letter() -> anyhow::Result<()> {
    // The shipped demo config, its plugin paths made absolute: the test does
    // not run from the repository's root, as `./dev run` does.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    crate::runtime::wasm("activitypub")?;
    let shipped = std::fs::read_to_string(root.join("config/demo.toml"))?;
    let plugins = root.join("plugins/target/").display().to_string();
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("demo.toml");
    std::fs::write(&config, shipped.replace("\"plugins/target/", &format!("\"{plugins}")))?;
    let path = config.display().to_string();
    let report = cli(&["--config", &path, "demo", "--short"], &[])
        .await?
        .map_err(|e| anyhow::anyhow!("the demo failed: {e}"))?;

    let lanes = rows(&report, "Lanes")?;
    for inbox in ["prompt", "slow", "flaky"] {
        let row = lanes
            .get(&format!("inbox {inbox}"))
            .with_context(|| format!("{inbox}: {report}"))?;
        ensure!(
            row[2] == "4" && row[4] == "0" && row[5] == "✓ in order",
            "{inbox}: {row:?}"
        );
    }
    ensure!(
        lanes["inbox flaky"][3] != "0",
        "the flaky inbox's op was retried: {report}"
    );
    let gone = &lanes["inbox gone"];
    ensure!(
        gone[2] == "0" && gone[4] == "4",
        "every op to the gone inbox is a dead letter: {gone:?}"
    );
    let vault = lanes.get("signer vault-agent").context("vault lane")?;
    ensure!(
        vault[2] == "8" && vault[4] == "0" && vault[5] == "✓ in order",
        "{vault:?}"
    );
    // Referral payouts come from the pool's four channels, the rewards key
    // only authorising the calls (no lane of its own) and paying the fees.
    // Dealt two each; an op waiting behind the channel whose first send was
    // answered TRY_AGAIN_LATER may be re-dealt to a free one.
    ensure!(!lanes.contains_key("signer rewards"), "{report}");
    let mut payouts = 0;
    for n in 1..=4 {
        let channel = lanes
            .get(&format!("channel payouts-{n} (pool payouts)"))
            .with_context(|| format!("channel payouts-{n}: {report}"))?;
        ensure!(
            channel[2] != "0" && channel[4] == "0" && channel[5] == "✓ in order",
            "{channel:?}"
        );
        payouts += channel[2].parse::<usize>()?;
    }
    ensure!(payouts == 8, "{report}");
    let pool = report
        .lines()
        .find(|l| l.starts_with("pool payouts: 8 transactions from 4 channels"))
        .with_context(|| format!("no pool line: {report}"))?;
    ensure!(
        pool.contains("a ledger") && pool.contains("every fee paid by the signer"),
        "{pool}"
    );

    // Priorities on the shared signer: the critical withdrawals, enqueued
    // after the backlog started, land before the low rebalances.
    let landed = report
        .lines()
        .find(|l| l.starts_with("signer vault-agent landed: "))
        .context("landed line")?;
    let (withdraw, rebalance) = (landed.find("withdraw"), landed.find("rebalance"));
    ensure!(matches!((withdraw, rebalance), (Some(w), Some(r)) if w < r), "{landed}");
    let kinds = rows(&report, "Kinds")?;
    let per_op = |kind: &str| -> anyhow::Result<i64> { Ok(kinds[kind][3].parse()?) };
    ensure!(
        per_op("withdraw")? > per_op("deposit")?,
        "critical ops bid the aggressive fee under congestion: {report}"
    );

    // The dead letter is explained, and the line printed to inspect it works.
    ensure!(report.contains("HTTP 410"), "{report}");
    let inspect = report
        .lines()
        .find_map(|l| l.strip_prefix("Inspect it:"))
        .context("no inspect line")?;
    let words: Vec<&str> = inspect.split_whitespace().collect();
    ensure!(
        words.len() == 6 && words[1] == "--config" && words[3..5] == ["ops", "show"],
        "{inspect}"
    );
    let shown = cli(&words[1..], &[])
        .await?
        .map_err(|e| anyhow::anyhow!("{inspect}: {e}"))?;
    ensure!(shown.contains("failed") && shown.contains("410"), "{shown}");
    Ok(())
}
