//! The WebAssembly runtime with real guest components from `plugins/`:
//! fault fixtures classified exactly, grants enforced, isolation under load,
//! quarantine, hot reload, and the frozen contract.

mod faults;
mod fee_policy;
mod grants;
mod reload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use laneway::config::{self, Config, PluginConfig};
use laneway::executor::{Checkpoint, CheckpointError};
use laneway::keys::KeyStore;
use laneway::runtime::plugin::{Health, Plugin};
use laneway::runtime::Runtime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A built guest component; `./dev test` builds them first.
pub fn wasm(name: &str) -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/wasm32-wasip2/release")
        .join(format!("{}.wasm", name.replace('-', "_")));
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build the plugins (./dev test does, or `cd plugins && cargo build --release --target wasm32-wasip2`)",
        path.display()
    );
    Ok(path)
}

/// Plugin settings from TOML on top of the defaults.
pub fn plugin_config(path: &std::path::Path, extra: &str) -> anyhow::Result<PluginConfig> {
    // Grants name keys by id; the keys themselves are handed in directly.
    let keys = "[keys.granted]\nalgorithm = \"ed25519\"\nenv = \"TEST_KEY_UNUSED\"\n";
    let config = config::from_toml_str(&format!(
        "{keys}[plugins.p]\npath = {:?}\n{extra}",
        path.display().to_string()
    ))?;
    config.plugins.get("p").cloned().context("plugin config")
}

/// A runtime with test-friendly settings.
pub fn runtime() -> anyhow::Result<Runtime> {
    let config = config::from_toml_str("")?;
    Runtime::new(&config.runtime).map_err(|e| anyhow::anyhow!("{e:#}"))
}

/// Loads a fixture with extra `[plugins.p]` settings and the given keys.
pub fn load(
    runtime: &Runtime,
    fixture: &str,
    extra: &str,
    keys: KeyStore,
) -> anyhow::Result<Result<Plugin, laneway::runtime::failure::PluginFailure>> {
    let path = wasm(fixture)?;
    let bytes = std::fs::read(&path)?;
    Ok(runtime.load(
        fixture,
        &bytes,
        &plugin_config(&path, extra)?,
        Arc::new(keys),
        Arc::new(Health::default()),
        3,
    ))
}

/// Records checkpoints instead of writing them.
#[derive(Default)]
pub struct Recorder(std::sync::Mutex<Vec<String>>);

#[async_trait]
impl Checkpoint for Recorder {
    async fn checkpoint(&self, receipt: &str) -> Result<(), CheckpointError> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(receipt.to_owned());
        Ok(())
    }
}

/// An attempt context for direct plugin calls: checkpoints go to `recorder`, no fee bid.
pub fn attempt(recorder: Arc<Recorder>) -> laneway::executor::Attempt {
    laneway::executor::Attempt::new(recorder, None)
}

/// A WIT op for direct plugin calls.
pub fn op(id: i64, payload: &str) -> laneway::runtime::bindings::executor::laneway::plugin::types::Op {
    use laneway::runtime::bindings::executor::laneway::plugin::types as wit;
    wit::Op {
        id,
        kind: "test".into(),
        outbox: "o".into(),
        priority: wit::Priority::Normal,
        attempt: 1,
        fee_bumps: 0,
        lanes: vec!["l".into()],
        payload: payload.into(),
        receipt: None,
        subject: None,
        correlation_id: None,
        config: "{}".into(),
    }
}

/// How the local test server answers.
#[derive(Debug, Clone, Copy)]
pub enum Serve {
    /// `200 ok`.
    Ok,
    /// Never answer.
    Hang,
}

/// A tiny HTTP server on 127.0.0.1 for host-import tests; returns its port.
pub async fn http_server(serve: Serve) -> anyhow::Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = socket.read(&mut buf).await;
                match serve {
                    Serve::Ok => {
                        let _ = socket
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                            .await;
                    }
                    Serve::Hang => tokio::time::sleep(Duration::from_secs(120)).await,
                }
            });
        }
    });
    Ok(port)
}

/// A config with the given plugins (`name -> (fixture, extra settings)`)
/// and kinds (`kind -> plugin`), on top of the dispatcher test defaults.
pub fn config_with(plugins: &[(&str, &str, &str)], kinds: &[(&str, &str)], extra: &str) -> anyhow::Result<Config> {
    let mut text = String::new();
    for (name, fixture, settings) in plugins {
        text.push_str(&format!(
            "[plugins.{name}]\npath = {:?}\n{settings}\n",
            wasm(fixture)?.display().to_string()
        ));
    }
    for (kind, plugin) in kinds {
        text.push_str(&format!("[kinds.{kind}]\nplugin = {plugin:?}\nlanes = \"optional\"\nfault_attempts = 2\nbackoff_base_ms = 5\nbackoff_max_ms = 10\n"));
    }
    let base = "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\nslot_ttl_ms = 2000\n";
    config::from_layers(&[base, &text, extra]).context("config")
}

#[test]
fn wit_versions_are_frozen() -> anyhow::Result<()> {
    use sha2::Digest as _;
    // A released contract never changes; a change is a new version in a new
    // directory (wit/README.md). Update this list only when adding one.
    const FROZEN: [(&str, &str); 5] = [
        ("laneway-plugin@1.0.0", FROZEN_1_0_0),
        ("laneway-plugin@1.1.0", FROZEN_1_1_0),
        ("laneway-plugin@1.2.0", FROZEN_1_2_0),
        ("laneway-plugin@1.3.0", FROZEN_1_3_0),
        ("laneway-plugin@1.4.0", FROZEN_1_4_0),
    ];
    for (dir, want) in FROZEN {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../wit").join(dir);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&root)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.sort();
        let mut hasher = sha2::Sha256::new();
        for file in files {
            hasher.update(
                file.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
                    .as_bytes(),
            );
            hasher.update(std::fs::read(&file)?);
        }
        let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        anyhow::ensure!(
            got == want,
            "{dir} changed (hash {got}); released contracts are frozen, add a new version instead"
        );
    }
    Ok(())
}

const FROZEN_1_0_0: &str = "17998fe83fbac751a00009ed61914d77dc1266cb763358eb3037668b4946135a";
const FROZEN_1_1_0: &str = "9fc8df28cc07d00a27bbc97c99e6321fcecb533ada9221da3727ee96310277ad";
const FROZEN_1_2_0: &str = "e2679a43844e5253905eeeb30b238ff9c65f62ebcea8293d33e138961f8af164";
const FROZEN_1_3_0: &str = "b4e7af19f3764f777e444d88e0711d5159ed27512baeee7cf0edf3cf649d336a";
const FROZEN_1_4_0: &str = "9955d1844e181c1b738fb577de98d290f16bd77459af55f6985f5f9aa53e1d29";

/// Components built against the frozen 1.0.0 and 1.1.0 contracts, committed
/// as built, still load and serve (without the 1.2.0 `validation` export,
/// their kinds' configs are simply not checked ahead): old plugins keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_built_against_1_0_0_and_1_1_0_keep_loading() -> anyhow::Result<()> {
    for version in ["1.0.0", "1.1.0"] {
        compat_fixture_serves(version)
            .await
            .with_context(|| format!("the {version} fixture"))?;
    }
    Ok(())
}

async fn compat_fixture_serves(version: &str) -> anyhow::Result<()> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/compat/laneway-plugin@{version}/noop.wasm"));
    let bytes = std::fs::read(&path)?;
    let rt = runtime()?;
    let plugin = rt
        .load(
            "compat",
            &bytes,
            &plugin_config(&path, "")?,
            Arc::new(KeyStore::default()),
            Arc::new(Health::default()),
            3,
        )
        .map_err(|e| anyhow::anyhow!("no longer loads: {e}"))?;
    anyhow::ensure!(plugin.inspection.version == version);
    anyhow::ensure!(!plugin.validates());
    anyhow::ensure!(plugin
        .validate_config("noop", "{}")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .is_none());
    let outcome = plugin
        .execute(op(1, "{}"), attempt(Arc::new(Recorder::default())))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    use laneway::runtime::bindings::executor::laneway::plugin::types as wit;
    anyhow::ensure!(matches!(outcome, wit::Outcome::Confirmed(_)), "{outcome:?}");
    let description = plugin.describe().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    anyhow::ensure!(description.name == "noop", "{description:?}");
    Ok(())
}

/// An op enqueued without lanes gets the lanes its kind's plugin names
/// (the noop plugin orders by outbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_names_the_lanes_of_an_op_enqueued_without_any() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let config = config_with(&[("noop", "noop", "")], &[("noop", "noop")], "")?;
    let host = laneway::runtime::host::PluginHost::new(&config)?;
    host.apply(&config).await?;
    let dispatcher = laneway::dispatch::Dispatcher::new(
        db.queue.clone(),
        host.registry(),
        config,
        Arc::new(laneway::clock::SystemClock),
    );
    let results = dispatcher
        .enqueue(&[laneway::queue::NewOp::new("actor-9", "noop", "{}")])
        .await?;
    let op = db.queue.get(results[0].id()).await?.context("op")?;
    anyhow::ensure!(op.lanes == vec!["actor-9".to_owned()], "{:?}", op.lanes);
    dispatcher.shutdown();
    Ok(())
}
