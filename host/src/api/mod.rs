//! The HTTP API `laneway run` serves (`[api] listen`): the producer routes
//! (`/api/v1/…`), the admin routes (`/api/admin/…`, seed 003's paths), the
//! public ones (`/metrics`, `/healthz`, `/readyz`, network conditions) and
//! `/api/openapi.json`.
//!
//! Every route is declared once, by its handler's `#[utoipa::path]`, and
//! [`api_router`] mounts exactly those declarations: the served routes and
//! the OpenAPI document cannot disagree. Every route but the public ones
//! asks for an API key with a scope ([`auth`]); every write records who did
//! it in the audit log; every failure is an [`ApiError`] with a stable code.
//! The handlers only call the [`Dispatcher`], its [`Queue`] and the plugin
//! host, as the CLI does, so both accept and refuse the same things.

mod admin;
pub mod auth;
mod console;
mod error;
mod inbox;
pub mod listener;
mod outcomes;
mod plugins;
mod producer;
mod public;
mod schemas;
mod steering;

use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderMap;
use axum::Router;
use serde_json::Value;
use tokio::net::TcpListener;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use error::{ApiError, ErrorBody};

use crate::config::FileSource;
use crate::dispatch::Dispatcher;
use crate::queue::{NewAuditEntry, Queue};
use crate::runtime::host::PluginHost;
use auth::Actor;

/// What every handler shares.
#[derive(Clone)]
pub struct ApiState {
    inner: Arc<StateInner>,
}

struct StateInner {
    dispatcher: Dispatcher,
    /// The plugin host and where its config comes from, for the
    /// `plugins:admin` routes (absent when the API runs without one).
    plugins: Option<(Arc<PluginHost>, FileSource)>,
    /// The public route's token bucket (full at start).
    public_bucket: Mutex<crate::ratelimit::LocalBucket>,
    /// The inboxes' key cache and the instance actor, for `[inbound]` as
    /// last read.
    inbound: Mutex<Arc<InboundSide>>,
    /// Places for `?wait=` requests held at once.
    waiters: Arc<tokio::sync::Semaphore>,
}

impl ApiState {
    /// State over a dispatcher (its queue, config, executors and metrics)
    /// and, for the plugin routes, the plugin host with its config source.
    pub fn new(dispatcher: Dispatcher, plugins: Option<(Arc<PluginHost>, FileSource)>) -> Self {
        let max_waiters = dispatcher.config().api.max_waiters;
        let inbound = Mutex::new(Arc::new(InboundSide::build(&dispatcher.config())));
        Self {
            inner: Arc::new(StateInner {
                dispatcher,
                plugins,
                inbound,
                waiters: Arc::new(tokio::sync::Semaphore::new(max_waiters)),
                public_bucket: Mutex::default(),
            }),
        }
    }

    fn dispatcher(&self) -> &Dispatcher {
        &self.inner.dispatcher
    }

    /// A place for a `?wait=` request, if one is free.
    fn waiter(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.inner.waiters.clone().try_acquire_owned().ok()
    }

    /// The inboxes' key cache, signer and actor document for the config in
    /// force: built again when a reload changed `[inbound]` or the fetch key
    /// (keys cached before are then fetched again).
    fn inbound(&self) -> Arc<InboundSide> {
        let config = self.dispatcher().config();
        let mut side = self.inner.inbound.lock().unwrap_or_else(PoisonError::into_inner);
        if !side.built_for(&config) {
            *side = Arc::new(InboundSide::build(&config));
        }
        side.clone()
    }

    fn queue(&self) -> &Arc<dyn Queue> {
        self.inner.dispatcher.queue()
    }

    fn plugins(&self) -> Option<&(Arc<PluginHost>, FileSource)> {
        self.inner.plugins.as_ref()
    }

    async fn authorize(&self, headers: &HeaderMap, scope: &str) -> Result<Actor, ApiError> {
        auth::authorize(self.queue().as_ref(), headers, scope).await
    }

    /// Records an operator write.
    async fn audit(
        &self,
        actor: &Actor,
        action: &str,
        target: String,
        before: Option<Value>,
        after: Option<Value>,
    ) -> Result<(), ApiError> {
        self.queue()
            .record_audit(&NewAuditEntry {
                actor: actor.0.clone(),
                action: action.to_owned(),
                target,
                before,
                after,
            })
            .await?;
        Ok(())
    }

    /// A listing's page size: `asked`, or 100, within 1 to `api.max_page`.
    fn page_limit(&self, asked: Option<u32>) -> Result<u32, ApiError> {
        let max = self.dispatcher().config().api.max_page;
        let limit = asked.unwrap_or(100);
        if !(1..=max).contains(&limit) {
            return Err(ApiError::invalid(format!("limit: expected 1 to {max}, got {limit}")));
        }
        Ok(limit)
    }

    /// Takes a token from the public route's bucket (`public_per_second`
    /// per second, bursts of as many).
    fn public_admit(&self) -> bool {
        let rate = self.dispatcher().config().api.public_per_second;
        self.inner
            .public_bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(f64::from(rate), rate, chrono::Utc::now())
    }
}

/// The document's frame: title, the bearer scheme, the tags.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "laneway",
        description = "The HTTP API of a laneway host: producers enqueue ops; operators read, steer and recover the queue. Keys are `Authorization: Bearer lw_<id>_<secret>`; each operation names the scope it needs."
    ),
    modifiers(&BearerScheme),
    components(schemas(schemas::OutcomeWebhook)),
    tags(
        (name = "producer", description = "Enqueue ops (scope ops:write) and follow their outcomes (outcomes:read)"),
        (name = "outbox", description = "Read and repair the queue (outbox:read, outbox:write)"),
        (name = "steering", description = "Pauses, held lanes, halted subjects, breakers, destination health (outbox:read, outbox:write)"),
        (name = "inbound", description = "ActivityPub inboxes ([inbound]): signed activities, no API key"),
        (name = "plugins", description = "Loaded plugins and reloads (plugins:admin)"),
        (name = "public", description = "Health, metrics and network conditions; no key")
    )
)]
struct Frame;

struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("lw_<id>_<secret>")
                    .build(),
            ),
        );
    }
}

/// Every route, each mounted from its own declaration.
fn api_router() -> OpenApiRouter<ApiState> {
    OpenApiRouter::with_openapi(Frame::openapi())
        .routes(routes!(public::healthz))
        .routes(routes!(public::readyz))
        .routes(routes!(public::metrics))
        .routes(routes!(public::network_conditions))
        .routes(routes!(public::openapi_json))
        .routes(routes!(producer::enqueue))
        .routes(routes!(producer::deliveries))
        .routes(routes!(outcomes::feed))
        .routes(routes!(admin::list))
        .routes(routes!(admin::stats))
        .routes(routes!(admin::activity))
        .routes(routes!(admin::dead_letters))
        .routes(routes!(console::whoami))
        .routes(routes!(admin::recover))
        .routes(routes!(admin::show))
        .routes(routes!(admin::retry))
        .routes(routes!(admin::cancel))
        .routes(routes!(admin::audit))
        .routes(routes!(steering::pauses, steering::pause))
        .routes(routes!(steering::resume))
        .routes(routes!(steering::lanes))
        .routes(routes!(steering::skip_lane))
        .routes(routes!(steering::subjects))
        .routes(routes!(steering::halt_subject))
        .routes(routes!(steering::unhalt_subject))
        .routes(routes!(steering::breakers))
        .routes(routes!(steering::open_breaker))
        .routes(routes!(steering::close_breaker))
        .routes(routes!(steering::destinations))
        .routes(routes!(steering::suspend_destination))
        .routes(routes!(steering::resume_destination))
        .routes(routes!(plugins::status))
        .routes(routes!(plugins::reload))
        .routes(routes!(inbox::personal))
        .routes(routes!(inbox::shared))
}

/// The OpenAPI document of every route.
pub fn openapi() -> utoipa::openapi::OpenApi {
    api_router().into_openapi()
}

/// What `/api/openapi.json` serves: [`openapi`] and the outcome webhook
/// as an OpenAPI 3.1 `webhooks` entry.
pub fn openapi_document() -> serde_json::Value {
    let mut document = serde_json::to_value(openapi()).unwrap_or_default();
    document["webhooks"] = schemas::webhooks();
    document
}

/// Every route, ready to serve.
pub fn router(state: ApiState) -> Router {
    let limit = state.dispatcher().config().api.max_body_bytes;
    let console = state.dispatcher().config().api.console;
    let (mut router, _) = api_router().split_for_parts();
    if console {
        router = router.merge(console::router());
    }
    router
        .fallback(instance_actor_or_not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// What the inboxes need, built from one `[inbound]` (and its fetch key).
struct InboundSide {
    /// What it was built from.
    config: crate::config::InboundConfig,
    fetch_key: Option<crate::keys::KeySource>,
    /// Actors' keys (absent if `[inbound]`'s client could not be built,
    /// which `check-config` reports).
    keys: Option<Arc<crate::inbound::KeyCache>>,
    /// The instance actor's path and document, when laneway serves it.
    actor: Option<(String, Value)>,
}

impl InboundSide {
    fn build(config: &crate::config::Config) -> Self {
        let inbound = config.inbound.clone();
        // The instance actor whose key signs every key fetch; a problem
        // with it (check-config reports it) leaves fetches unsigned.
        let signer = match crate::inbound::FetchSigner::from_config(config) {
            Ok(signer) => signer.map(Arc::new),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot load the instance actor's key; key fetches go unsigned.");
                None
            }
        };
        let keys = match crate::inbound::key_client(&inbound) {
            Ok(client) => Some(Arc::new(
                crate::inbound::KeyCache::new(client, crate::inbound::KeySettings::of(&inbound))
                    .signed_by(signer.clone()),
            )),
            Err(e) => {
                tracing::warn!(error = %e, "Cannot build the inbound key client; the inboxes refuse every request.");
                None
            }
        };
        let actor = signer
            .filter(|_| inbound.serve_fetch_actor)
            .and_then(|signer| match signer.actor_document() {
                Ok(document) => Some((signer.actor_path(), document)),
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot publish the instance actor's document.");
                    None
                }
            });
        Self {
            fetch_key: config.keys.get(&inbound.fetch_key).cloned(),
            config: inbound,
            keys,
            actor,
        }
    }

    /// Whether `config` would build the same (a key file rewritten under
    /// the same path is read at the next change of `[inbound]`).
    fn built_for(&self, config: &crate::config::Config) -> bool {
        self.config == config.inbound && self.fetch_key.as_ref() == config.keys.get(&config.inbound.fetch_key)
    }
}

/// The instance actor's document at its path (served from the fallback, so
/// no configured path can collide with a route), else 404.
async fn instance_actor_or_not_found(
    State(state): State<ApiState>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    match &state.inbound().actor {
        Some((path, document)) if method == axum::http::Method::GET && uri.path() == path => (
            [(axum::http::header::CONTENT_TYPE, "application/activity+json")],
            document.to_string(),
        )
            .into_response(),
        _ => ApiError::not_found("no such route").into_response(),
    }
}

/// Serves the API on `listener` until `stop` resolves.
///
/// # Errors
///
/// The server's I/O error.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = listener::Limits::of(&state.dispatcher().config().api);
    listener::serve(listener, router(state), limits, stop).await
}
