//! `laneway-faults`: runs the fault plans and prints the checker's table;
//! exits non-zero when any run fails its checks.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use laneway_faults::check::{check, table};
use laneway_faults::neighbours::{self, NeighboursPlan};
use laneway_faults::run::{run, Backend, Env, Fault, Plan};
use laneway_faults::stellar::{StellarFault, StellarPlan};
use rand::Rng as _;

#[derive(Parser)]
#[command(about = "laneway's fault harness: the binary killed and stalled mid-flight, then checked")]
struct Args {
    /// reduced (every fault once, 5k ops per backend: ./dev test runs it) or
    /// full (100k ops, 50 kills, every fault several times per backend).
    #[arg(long, default_value = "reduced")]
    size: String,
    /// sqlite, postgres or both.
    #[arg(long, default_value = "both")]
    backend: String,
    /// The PostgreSQL server; each run makes a database of its own there.
    #[arg(long, env = "TEST_PG_URL", default_value = "postgres://postgres@127.0.0.1:5432/test")]
    pg: String,
    /// The laneway binary under test.
    #[arg(long, env = "LW_LANEWAY_BIN")]
    laneway: Option<PathBuf>,
    /// faults, stellar (the Stellar kinds against the fake RPC), hostile
    /// (the API fed generated garbage), neighbours (hostile plugins beside
    /// real traffic, against a clean run), disk (SQLite on a full disk) or
    /// all.
    #[arg(long, default_value = "all")]
    only: String,
    /// The fake Stellar RPC (`cargo test` builds it as the laneway-tests
    /// example `fake_stellar_rpc`).
    #[arg(long, env = "LW_FAKE_RPC_BIN")]
    fake_rpc: Option<PathBuf>,
    /// Keep each run's directory (database, config, logs) under this one.
    #[arg(long)]
    keep: Option<PathBuf>,
    /// The neighbours run's seconds of load per run (default: 20 reduced,
    /// 120 full).
    #[arg(long)]
    neighbour_seconds: Option<u64>,
    /// The neighbours run's control/hostile pairs (default: 1 reduced, 3
    /// full); more rounds for a figure less at the mercy of one run's noise.
    #[arg(long)]
    neighbour_rounds: Option<usize>,
}

/// Every fault of a plan, `kills` of them random kill -9s (the failpoints
/// first, so each is hit while there is work).
fn faults(backend: &Backend, kills: usize, rounds: usize, full: bool) -> Vec<Fault> {
    let mut rng = rand::thread_rng();
    let mut plan = Vec::new();
    for _ in 0..rounds {
        // The relay passes a page every 100 ms at most: a low N is hit.
        // The pruner passes every 500 ms once ops are past retention;
        // inbound activities arrive a few a second per sender.
        for (point, most) in [
            ("claimed", 40),
            ("settling", 40),
            ("relay", 8),
            ("pruning", 3),
            ("inbound", 10),
            ("accepted", 10),
        ] {
            plan.push(Fault::Failpoint(format!("{point}@{}", rng.gen_range(1..=most))));
        }
        plan.push(Fault::Stall);
        plan.push(Fault::RewriteConfig);
        plan.push(Fault::ReplacePlugin);
        plan.push(Fault::ThreeHosts);
        plan.push(Fault::Network);
        if matches!(backend, Backend::Postgres(_)) {
            plan.push(Fault::TerminateConnections);
            // Restarting the server disturbs whatever else uses it: the
            // full run only, on a machine of its own.
            if full {
                plan.push(Fault::RestartPostgres);
            }
        }
    }
    let extra = kills.saturating_sub(plan.len());
    for _ in 0..extra {
        plan.push(Fault::Kill { after_ms: (200, 1500) });
    }
    plan
}

/// The Stellar plan: every failpoint and RPC fault `rounds` times, then
/// random kills up to `kills`.
fn stellar_faults(kills: usize, rounds: usize) -> Vec<StellarFault> {
    let mut rng = rand::thread_rng();
    let mut plan = Vec::new();
    for _ in 0..rounds {
        plan.push(StellarFault::Failpoint(format!("claimed@{}", rng.gen_range(1..=5))));
        plan.push(StellarFault::Failpoint(format!("settling@{}", rng.gen_range(1..=5))));
        for rpc in ["504 2", "hang 2", "lose", "busy"] {
            plan.push(StellarFault::Rpc(rpc));
        }
        plan.push(StellarFault::Stall);
    }
    let extra = kills.saturating_sub(plan.len());
    plan.extend(std::iter::repeat_n(StellarFault::Kill, extra));
    plan
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let debug = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| repo.join("target"), PathBuf::from)
        .join("debug");
    let laneway = args.laneway.unwrap_or_else(|| debug.join("laneway"));
    anyhow::ensure!(
        laneway.exists(),
        "{} is missing: build it (cargo build -p laneway) or pass --laneway",
        laneway.display()
    );
    let backends = match args.backend.as_str() {
        "sqlite" => vec![Backend::Sqlite],
        "postgres" => vec![Backend::Postgres(args.pg.clone())],
        "both" => vec![Backend::Sqlite, Backend::Postgres(args.pg.clone())],
        other => anyhow::bail!("--backend: expected sqlite, postgres or both, got {other:?}"),
    };
    let (activities, inbound_each, kills, rounds, per_operation, payments, neighbour_seconds) = match args.size.as_str()
    {
        "reduced" => (250, 50, 5, 1, 30, 150, 20),
        "full" => (5000, 1000, 50, 3, 300, 2000, 120),
        other => anyhow::bail!("--size: expected reduced or full, got {other:?}"),
    };
    let mut failed = 0;
    // Each run's directory under --keep, by the run's name.
    let env_for = |name: String| Env {
        repo: repo.clone(),
        laneway: laneway.clone(),
        keep: args.keep.as_ref().map(|k| k.join(name)),
    };
    anyhow::ensure!(
        ["all", "faults", "stellar", "hostile", "neighbours", "disk"].contains(&args.only.as_str()),
        "--only: expected faults, stellar, hostile, neighbours, disk or all, got {:?}",
        args.only
    );
    let only = |what: &str| args.only == "all" || args.only == what;
    let disk = only("disk") && backends.contains(&Backend::Sqlite);
    let backends_again = if only("hostile") { backends.clone() } else { Vec::new() };
    let stellar_backends = if only("stellar") { backends.clone() } else { Vec::new() };
    let neighbour_backends = if only("neighbours") {
        backends.clone()
    } else {
        Vec::new()
    };
    let backends = if only("faults") { backends } else { Vec::new() };
    for backend in backends {
        let plan = Plan {
            faults: faults(&backend, kills, rounds, args.size == "full"),
            backend,
            activities,
            inboxes: 20,
            outboxes: 4,
            senders: 4,
            inbound_each,
            drain_deadline: Duration::from_secs(if activities > 1000 { 1800 } else { 120 }),
        };
        let env = env_for(plan.backend.name().to_owned());
        println!(
            "laneway-faults: {} ops on {}, {} faults, {}",
            plan.ops(),
            plan.backend.name(),
            plan.faults.len(),
            laneway.display()
        );
        let outcome = run(&plan, &env)
            .await
            .with_context(|| format!("the {} run", plan.backend.name()))?;
        for line in &outcome.faults {
            println!("  {line}");
        }
        let report = check(&outcome.history);
        println!(
            "  {} lease expiries recorded (on ops not pruned yet); {:.1} s",
            outcome.lease_expired,
            outcome.elapsed.as_secs_f64()
        );
        println!("{}\n", table(plan.backend.name(), &report));
        if !report.passed() {
            failed += 1;
        }
    }
    // The Stellar kinds against the fake RPC as a process.
    if !stellar_backends.is_empty() || !neighbour_backends.is_empty() {
        // Beside the binary under test, else beside this one (where
        // `cargo test` built it), else in the target directory.
        let fake_rpc = match &args.fake_rpc {
            Some(path) => path.clone(),
            None => [
                laneway.parent().map(PathBuf::from),
                std::env::current_exe()
                    .ok()
                    .and_then(|exe| exe.parent().map(PathBuf::from)),
            ]
            .into_iter()
            .flatten()
            .map(|dir| dir.join("examples/fake_stellar_rpc"))
            .find(|path| path.exists())
            .unwrap_or_else(|| debug.join("examples/fake_stellar_rpc")),
        };
        anyhow::ensure!(
            fake_rpc.exists(),
            "{} is missing: build it (cargo build -p laneway-tests --example fake_stellar_rpc) or pass --fake-rpc",
            fake_rpc.display()
        );
        for backend in stellar_backends {
            let plan = StellarPlan {
                faults: stellar_faults(kills * 2, rounds),
                backend,
                ops: payments,
                close_ms: 250,
                drain_deadline: Duration::from_secs(if payments > 1000 { 1800 } else { 180 }),
            };
            let env = env_for(format!("stellar-{}", plan.backend.name()));
            println!(
                "laneway-faults: {} Stellar payments on {}, deposits from a signer and payouts from a pool of four channels, {} faults",
                plan.ops,
                plan.backend.name(),
                plan.faults.len()
            );
            let outcome = laneway_faults::stellar::run(&plan, &env, &fake_rpc)
                .await
                .with_context(|| format!("the Stellar run on {}", plan.backend.name()))?;
            for line in &outcome.faults {
                println!("  {line}");
            }
            println!("  {:.1} s", outcome.elapsed.as_secs_f64());
            let report = laneway_faults::check::check_stellar(&outcome.history);
            println!("{}\n", report.table(&format!("stellar {}", plan.backend.name())));
            if !report.passed() {
                failed += 1;
            }
        }
        // Hostile plugins beside the real kinds, against clean runs.
        for backend in neighbour_backends {
            let plan = NeighboursPlan {
                backend,
                seconds: args.neighbour_seconds.unwrap_or(neighbour_seconds),
                activities_per_s: 10.0,
                payments_per_s: 2.0,
                hostile_per_s: 1.0,
                rounds: args.neighbour_rounds.unwrap_or(rounds),
            };
            let env = env_for(format!("neighbours-{}", plan.backend.name()));
            println!(
                "laneway-faults: hostile plugins as neighbours on {}: {} s of {} fan-outs/s to {} inboxes and {} payments/s, beside {} hostile kinds fed {} op/s each, against a clean run (well-behaved plugins in their place) and a failing one (plugins that fail politely); {} round(s)",
                plan.backend.name(),
                plan.seconds,
                plan.activities_per_s,
                neighbours::INBOXES,
                plan.payments_per_s,
                neighbours::FIXTURES.len() + 1,
                plan.hostile_per_s,
                plan.rounds
            );
            let runs = neighbours::run(&plan, &env, &fake_rpc)
                .await
                .with_context(|| format!("the neighbours run on {}", plan.backend.name()))?;
            for run in &runs {
                println!(
                    "  {} run: {:.1} s, the host's CPU {}",
                    run.mode.name(),
                    run.elapsed.as_secs_f64(),
                    run.cpu
                        .map_or("unknown".to_owned(), |c| format!("{:.1} s", c.as_secs_f64()))
                );
            }
            let report = neighbours::compare(&runs);
            println!("{}\n", report.table(&format!("neighbours {}", plan.backend.name())));
            if !report.passed() {
                failed += 1;
            }
        }
    }
    // Hostile input: every API operation, generated garbage, both backends.
    for backend in backends_again {
        let env = env_for(format!("hostile-{}", backend.name()));
        let findings = laneway_faults::hostile::against(&backend, &env, per_operation)
            .await
            .with_context(|| format!("the hostile-input run on {}", backend.name()))?;
        println!(
            "hostile input on {}: {} requests to every API operation; answers by class: {} no answer (closed on an oversized body), {} 2xx, {} 3xx, {} 4xx, {} 5xx",
            backend.name(),
            findings.requests,
            findings.by_class[0],
            findings.by_class[2],
            findings.by_class[3],
            findings.by_class[4],
            findings.by_class[5],
        );
        if findings.failures.is_empty() {
            println!("PASSED: no 5xx, no hang, no refused request changed a row, the host still ready\n");
        } else {
            println!("FAILED");
            for failure in findings.failures.iter().take(20) {
                println!("  {failure}");
            }
            failed += 1;
        }
    }
    if disk {
        let env = env_for("disk-full".to_owned());
        let outcome = laneway_faults::disk::run(&env).await.context("the disk-full run")?;
        match &outcome.not_run {
            Some(why) => println!("disk full (SQLite): NOT RUN: {why}\n"),
            None => {
                let report = check(&outcome.history);
                println!(
                    "disk full (SQLite, a 12 MiB tmpfs): {} fan-outs taken before the disk filled; then {}\n  kill -9 while full: {}\n  integrity_check after space returned: {}",
                    outcome.acked_before, outcome.refusal, outcome.restart, outcome.integrity
                );
                println!("{}\n", table("disk full", &report));
                if !report.passed() || outcome.integrity != "ok" {
                    failed += 1;
                }
            }
        }
    }
    if failed > 0 {
        eprintln!("laneway-faults: {failed} run(s) failed their checks");
        std::process::exit(1);
    }
    Ok(())
}
