//! Micro-benchmark: what laneway's plugin call path costs per op on top of
//! wasmtime itself, measured in one run on the same component bytes.
//!
//! Both paths create a fresh store, instantiate the noop executor from a
//! pre-instantiated component and call `execute` once per op. laneway's path
//! adds its sandbox (limiter, epoch deadline, outer timeout, grants, denial
//! and health accounting) and the type conversions. Run with
//! `cargo run --release --example plugin_overhead [-- OPS]` after building
//! the plugins.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use laneway::executor::{Checkpoint, CheckpointError};
use laneway::keys::KeyStore;
use laneway::runtime::bindings::executor::laneway::plugin::types as wit;
use laneway::runtime::bindings::executor::ExecutorPluginPre;
use laneway::runtime::plugin::Health;
use laneway::runtime::Runtime;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

struct NoCheckpoint;

#[async_trait]
impl Checkpoint for NoCheckpoint {
    async fn checkpoint(&self, _receipt: &str) -> Result<(), CheckpointError> {
        Ok(())
    }
}

/// The least a store can hold and still run a wasip2 component.
struct Bare {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl WasiView for Bare {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl wit::Host for Bare {}

fn op(id: i64) -> wit::Op {
    wit::Op {
        id,
        kind: "noop".into(),
        outbox: "bench".into(),
        priority: wit::Priority::Normal,
        attempt: 1,
        fee_bumps: 0,
        lanes: vec!["bench".into()],
        payload: "{}".into(),
        receipt: None,
        subject: None,
        correlation_id: None,
        config: "{}".into(),
    }
}

fn per_op(elapsed: Duration, ops: u32) -> f64 {
    elapsed.as_secs_f64() * 1e6 / f64::from(ops)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let ops: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release/noop.wasm");
    let bytes = std::fs::read(&path).with_context(|| format!("{} (build the plugins first)", path.display()))?;
    let config = laneway::config::from_toml_str("")?;

    // laneway's path.
    let runtime = Runtime::new(&config.runtime).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let plugin_config =
        laneway::config::from_toml_str(&format!("[plugins.noop]\npath = {:?}\n", path.display().to_string()))?
            .plugins
            .remove("noop")
            .context("plugin config")?;
    let plugin = runtime
        .load(
            "noop",
            &bytes,
            &plugin_config,
            Arc::new(KeyStore::default()),
            Arc::new(Health::default()),
            5,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let checkpoint = laneway::executor::Attempt::new(Arc::new(NoCheckpoint), None);

    // Bare wasmtime: same engine settings, same bytes, same generated bindings.
    let mut wasm_config = wasmtime::Config::new();
    wasm_config.wasm_component_model(true).epoch_interruption(true);
    wasm_config.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(
        wasmtime::PoolingAllocationConfig::new(),
    ));
    let engine = wasmtime::Engine::new(&wasm_config).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let component = Component::new(&engine, &bytes).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let mut linker: Linker<Bare> = Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    wit::add_to_linker::<Bare, wasmtime::component::HasSelf<Bare>>(&mut linker, |s| s)
        .map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let pre = ExecutorPluginPre::new(
        linker
            .instantiate_pre(&component)
            .map_err(|e| anyhow::anyhow!("{e:#}"))?,
    )
    .map_err(|e| anyhow::anyhow!("{e:#}"))?;

    // Warm both, then alternate rounds so machine noise hits both alike.
    let bare_call = async |id: i64| -> anyhow::Result<()> {
        let mut store = wasmtime::Store::new(
            &engine,
            Bare {
                wasi: WasiCtx::builder().build(),
                table: ResourceTable::new(),
            },
        );
        store.set_epoch_deadline(u64::MAX / 2);
        let bindings = pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        bindings
            .laneway_plugin_executor()
            .call_execute(&mut store, &op(id))
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}"))?;
        Ok(())
    };
    for i in 0..500 {
        bare_call(i).await?;
        plugin
            .execute(op(i), checkpoint.clone())
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let rounds = 10;
    let per_round = ops / rounds;
    let (mut bare, mut ours) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        let start = Instant::now();
        for i in 0..per_round {
            bare_call(i64::from(round * per_round + i)).await?;
        }
        bare += start.elapsed();
        let start = Instant::now();
        for i in 0..per_round {
            plugin
                .execute(op(i64::from(round * per_round + i)), checkpoint.clone())
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        ours += start.elapsed();
    }
    let n = per_round * rounds;
    let (b, o) = (per_op(bare, n), per_op(ours, n));
    println!("plugin call overhead, noop executor, {n} ops each, fresh store + instantiate + execute per op");
    println!("  bare wasmtime:   {b:8.2} µs/op");
    println!("  laneway runtime: {o:8.2} µs/op");
    println!("  laneway adds:    {:8.2} µs/op (target ≤ 10)", o - b);
    println!("  pooling allocator: {}", runtime.pooling());
    Ok(())
}
