//! Hostile input against the running binary's HTTP API: every operation in
//! `/api/openapi.json`, called with generated garbage (bodies of wrong
//! types, huge and deeply nested JSON, invalid UTF-8; hostile path, query
//! and header values; no key, a forged key, a producer key, an admin key).
//! What must hold: no answer is a 5xx, no request hangs, a refused request
//! (4xx) changes no row, and the host is still ready at the end.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _};
use rand::seq::SliceRandom as _;
use rand::Rng as _;
use serde_json::{json, Value};
use sqlx::Row as _;

use crate::procs;
use crate::run::{config_text, prepare, start_paused, write_keys, Backend, Env, Workspace};

/// One API operation from the OpenAPI document.
#[derive(Debug, Clone)]
pub struct Operation {
    pub method: String,
    pub path: String,
    pub query: Vec<String>,
    /// Top-level property names of the JSON body, when it has one.
    pub body_fields: Option<Vec<String>>,
}

/// The operations of an OpenAPI 3 document.
pub fn operations(doc: &Value) -> Vec<Operation> {
    let mut out = Vec::new();
    let Some(paths) = doc["paths"].as_object() else {
        return out;
    };
    for (path, item) in paths {
        let Some(item) = item.as_object() else { continue };
        for (method, op) in item {
            if !["get", "post", "put", "patch", "delete"].contains(&method.as_str()) {
                continue;
            }
            let query = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "query")
                .filter_map(|p| p["name"].as_str().map(str::to_owned))
                .collect();
            let body_fields = op["requestBody"]["content"]["application/json"]["schema"]
                .as_object()
                .map(|schema| schema_fields(doc, &Value::Object(schema.clone())));
            out.push(Operation {
                method: method.to_uppercase(),
                path: path.clone(),
                query,
                body_fields,
            });
        }
    }
    out
}

fn schema_fields(doc: &Value, schema: &Value) -> Vec<String> {
    let resolved = match schema["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
    {
        Some(name) => &doc["components"]["schemas"][name],
        None => schema,
    };
    resolved["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

/// A hostile JSON value of any type.
fn value(rng: &mut impl rand::Rng, depth: u32) -> Value {
    match rng.gen_range(0..14) {
        0 => Value::Null,
        1 => json!(rng.gen::<bool>()),
        2 => json!(rng.gen::<i64>()),
        3 => json!(-1),
        4 => json!(1e308),
        5 => json!(u64::MAX),
        6 => json!(""),
        7 => json!("\u{0}\u{202e}<script>x</script>' OR 1=1 --"),
        8 => json!("x".repeat(rng.gen_range(1000..70_000))),
        9 => json!(["critical", "normal", "bogus"].choose(rng).copied().unwrap_or("bogus")),
        10 if depth < 3 => Value::Array((0..rng.gen_range(0..4)).map(|_| value(rng, depth + 1)).collect()),
        11 if depth < 3 => {
            let mut map = serde_json::Map::new();
            for _ in 0..rng.gen_range(0..4) {
                map.insert(format!("k{}", rng.gen::<u8>()), value(rng, depth + 1));
            }
            Value::Object(map)
        }
        12 => json!("http://169.254.169.254/latest/meta-data/"),
        _ => json!(format!("{}", rng.gen::<u32>())),
    }
}

/// A hostile request body (bytes) for `op`.
fn body(rng: &mut impl rand::Rng, op: &Operation) -> Vec<u8> {
    match rng.gen_range(0..10) {
        0 => Vec::new(),
        1 => b"{\"unterminated\": ".to_vec(),
        2 => vec![0xff, 0xfe, b'{', 0xc3, b'}'],
        3 => format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        // Past api.max_body_bytes (4 MiB).
        4 => format!("{{\"payload\": \"{}\"}}", "a".repeat(5 << 20)).into_bytes(),
        5 => b"{\"a\": 1, \"a\": 2}".to_vec(),
        _ => {
            // The operation's own fields, each of a hostile value.
            let mut map = serde_json::Map::new();
            for field in op.body_fields.iter().flatten() {
                if rng.gen_bool(0.8) {
                    map.insert(field.clone(), value(rng, 0));
                }
            }
            if rng.gen_bool(0.2) {
                map.insert("unknown_field".to_owned(), value(rng, 0));
            }
            serde_json::to_vec(&Value::Object(map)).unwrap_or_default()
        }
    }
}

/// A hostile path or query value.
fn text(rng: &mut impl rand::Rng) -> String {
    [
        "-1",
        "0",
        "99999999999999999999999",
        "abc",
        "%00",
        "..%2f..%2fetc%2fpasswd",
        "%27%20OR%201%3D1",
        "%E2%80%AE",
        "%ff%fe",
        "1e9",
        "",
        "critical",
        "failed",
    ]
    .choose(rng)
    .map(|s| (*s).to_owned())
    .unwrap_or_default()
}

/// One request's URL for `op` against `base`, with hostile path and query.
fn url(rng: &mut impl rand::Rng, base: &str, op: &Operation, ids: &[i64]) -> String {
    let mut path = String::new();
    let mut rest = op.path.as_str();
    while let Some(open) = rest.find('{') {
        path.push_str(&rest[..open]);
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c + 1);
        // A real id half the time, so the handler gets past its lookup.
        match ids.choose(rng) {
            Some(id) if rng.gen_bool(0.5) => path.push_str(&id.to_string()),
            _ => path.push_str(&text(rng)),
        }
        rest = &rest[close.min(rest.len())..];
    }
    path.push_str(rest);
    let mut query = Vec::new();
    for name in &op.query {
        if rng.gen_bool(0.6) {
            query.push(format!("{name}={}", text(rng)));
        }
    }
    if rng.gen_bool(0.1) {
        query.push(format!("limit={}", "9".repeat(40)));
    }
    if query.is_empty() {
        format!("{base}{path}")
    } else {
        format!("{base}{path}?{}", query.join("&"))
    }
}

/// How a request authenticates.
#[derive(Debug, Clone, Copy)]
enum Auth {
    None,
    Forged,
    Producer,
    Admin,
}

/// What the run found.
#[derive(Debug, Default)]
pub struct Findings {
    pub requests: usize,
    pub by_class: [usize; 6],
    /// 5xx answers, hangs, refused requests that changed rows.
    pub failures: Vec<String>,
}

/// A fingerprint of every row a request could change.
pub type Fingerprint = Vec<i64>;

/// Sends `per_operation` hostile requests to every operation. `fingerprint`
/// reads the database; `ids` are real op ids.
pub async fn run<F, Fut>(
    base: &str,
    keys: (&str, &str),
    ids: &[i64],
    per_operation: usize,
    mut fingerprint: F,
) -> anyhow::Result<Findings>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Fingerprint>>,
{
    let http = reqwest::Client::builder().no_proxy().build()?;
    let doc = http
        .get(format!("{base}/api/openapi.json"))
        .send()
        .await?
        .text()
        .await?;
    let doc: Value = serde_json::from_str(&doc).context("the OpenAPI document")?;
    let ops = operations(&doc);
    anyhow::ensure!(ops.len() >= 20, "only {} operations in the OpenAPI document", ops.len());
    let mut findings = Findings::default();
    let mut rng = rand::thread_rng();
    for op in &ops {
        for _ in 0..per_operation {
            let auth = [Auth::None, Auth::Forged, Auth::Producer, Auth::Admin]
                .choose(&mut rng)
                .copied()
                .unwrap_or(Auth::None);
            let target = url(&mut rng, base, op, ids);
            let method = reqwest::Method::from_bytes(op.method.as_bytes())?;
            let mut request = http.request(method, &target).timeout(Duration::from_secs(10));
            request = match auth {
                Auth::None => request,
                Auth::Forged => request.header(
                    "authorization",
                    ["Bearer lw_forged", "Basic YTpi", "Bearer ", "bearer \u{7f}"]
                        .choose(&mut rng)
                        .copied()
                        .unwrap_or("Bearer x"),
                ),
                Auth::Producer => request.bearer_auth(keys.0),
                Auth::Admin => request.bearer_auth(keys.1),
            };
            if rng.gen_bool(0.7) {
                request = request.header("content-type", "application/json");
            } else if rng.gen_bool(0.5) {
                request = request.header("content-type", "text/plain; charset=\u{ff}");
            }
            if rng.gen_bool(0.1) {
                request = request.header("idempotency-key", "k".repeat(rng.gen_range(1..20_000)));
            }
            if rng.gen_bool(0.1) {
                request = request.header(
                    "x-hostile",
                    reqwest::header::HeaderValue::from_bytes(&[0xff, b'a', 0x80])?,
                );
            }
            if op.method != "GET" && op.method != "DELETE" {
                request = request.body(body(&mut rng, op));
            }
            let before = fingerprint().await?;
            let started = std::time::Instant::now();
            let answer = request.send().await;
            findings.requests += 1;
            let status = match answer {
                Ok(answer) => answer.status().as_u16(),
                Err(e) if e.is_timeout() => {
                    findings
                        .failures
                        .push(format!("{} {target}: no answer in 10 s", op.method));
                    continue;
                }
                // The server closing on an oversized body is an answer.
                Err(_) => {
                    findings.by_class[0] += 1;
                    continue;
                }
            };
            findings.by_class[usize::from(status / 100).min(5)] += 1;
            if status >= 500 {
                findings.failures.push(format!(
                    "{} {target} ({auth:?}) answered {status} in {:?}",
                    op.method,
                    started.elapsed()
                ));
            } else if status >= 400 {
                let after = fingerprint().await?;
                if after != before {
                    findings.failures.push(format!(
                        "{} {target} ({auth:?}) was refused with {status} but changed rows: {before:?} -> {after:?}",
                        op.method
                    ));
                }
            }
        }
    }
    Ok(findings)
}

/// Every row a refused request could have changed, as numbers; `due` is
/// the dialect's `next_attempt_at` in milliseconds.
fn fingerprint_sql(due: &str) -> String {
    format!(
        "SELECT
    (SELECT count(*) FROM ops),
    (SELECT CAST(coalesce(sum(attempts + attempt_floor + priority + length(status)), 0) AS BIGINT) FROM ops),
    (SELECT CAST(coalesce(sum({due} % 1000003), 0) AS BIGINT) FROM ops),
    (SELECT count(*) FROM attempts),
    (SELECT count(*) FROM audit_log),
    (SELECT count(*) FROM api_keys),
    (SELECT count(*) FROM pauses),
    (SELECT count(*) FROM halted_subjects),
    (SELECT count(*) FROM lane_halts),
    (SELECT count(*) FROM records)"
    )
}

/// The hostile-input run: one host, a few waiting ops (their kind paused),
/// and [`run`] against its API.
pub async fn against(backend: &Backend, env: &Env, per_operation: usize) -> anyhow::Result<Findings> {
    let workspace = Workspace::new(env, backend).await?;
    let (dir, db_url) = (&workspace.dir, workspace.db_url.as_str());
    let keys = write_keys(dir)?;
    let plugins = env.repo.join("plugins/target/wasm32-wasip2/release");
    // No webhook: an op a request cancels must start nothing in the
    // background, or the fingerprints would move on their own.
    let laneway = prepare(
        env,
        dir,
        &config_text(db_url, &plugins, &keys.pem, &keys.hook_key, None),
    )?;
    let producer = laneway.api_key("producer", "ops:write")?;
    let admin = laneway.api_key("admin", "ops:write,outbox:read,outbox:write,plugins:admin")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    // Waiting ops for the id-taking routes to find: their kind is paused.
    let (mut host, port, base) = start_paused(&laneway, &http, &admin, "activitypub").await?;
    let seed = json!({"outbox": "https://faults.laneway.example/actors/0",
                      "activity": {"id": "https://faults.laneway.example/a/1", "type": "Create"},
                      "recipients": ["http://127.0.0.1:9/users/a/inbox", "http://127.0.0.1:9/users/b/inbox"]});
    let answer = procs::post_json(&http, format!("{base}/api/v1/activitypub/deliveries"), &producer, &seed)
        .send()
        .await?
        .text()
        .await?;
    let answer: Value = serde_json::from_str(&answer).with_context(|| answer.clone())?;
    let ids: Vec<i64> = answer["deliveries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["id"].as_i64())
        .collect();
    ensure!(ids.len() == 2, "seeding: {answer}");
    macro_rules! fingerprint {
        ($pool:expr, $due:expr, $names:expr) => {{
            let pool = $pool;
            let sql: Arc<str> = $names(&fingerprint_sql($due)).into();
            run(&base, (&producer, &admin), &ids, per_operation, || {
                let (pool, sql) = (pool.clone(), sql.clone());
                async move {
                    let row = sqlx::query(&sql).fetch_one(&pool).await?;
                    (0..10).map(|i| Ok(row.try_get::<i64, _>(i)?)).collect()
                }
            })
            .await
        }};
    }
    let findings = if db_url.starts_with("sqlite") {
        fingerprint!(
            sqlx::SqlitePool::connect(db_url).await?,
            "next_attempt_at",
            crate::run::on_sqlite
        )
    } else {
        fingerprint!(
            sqlx::PgPool::connect(db_url).await?,
            "CAST(extract(epoch FROM next_attempt_at) * 1000 AS BIGINT)",
            str::to_owned
        )
    };
    let mut findings = findings?;
    if let Some(status) = host.exited() {
        findings.failures.push(format!("the host exited: {status}"));
    } else if procs::ready(&http, &mut host, port).await.is_err() {
        findings.failures.push("the host is no longer ready".to_owned());
    }
    drop(host);
    // What was kept is told only with the failures: a passing run has none
    // to add to.
    let passed = findings.failures.is_empty();
    let kept = workspace.finish(passed).await?;
    if !passed {
        findings.failures.extend(kept);
    }
    Ok(findings)
}
