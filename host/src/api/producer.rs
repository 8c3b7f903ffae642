//! The producer routes (scope `ops:write`): `POST /api/v1/ops`, one op or a
//! batch, through the same preparation as `laneway enqueue` (the kind's
//! rules, the plugin's lanes when none are given, the queue's payload
//! checks); and `POST /api/v1/activitypub/deliveries`, an activity and its
//! recipients through the same fan-out plan as `laneway fanout`. Both end in
//! the dispatcher's enqueue, which wakes the outbox at once.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use super::error::{BodyRefusals, Refusals};
use super::{ApiError, ApiState, ErrorBody};
use crate::enqueue::{self, EnqueueRequest};
use crate::op::Priority;
use crate::queue::{self, Enqueued, NewOp};

/// Most ops one request may carry.
const MAX_BATCH: usize = 1000;

/// The longest `delay_ms`: a year.
const MAX_DELAY_MS: u64 = 366 * 24 * 3600 * 1000;

/// One op as a producer posts it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct OpBody {
    kind: String,
    outbox: String,
    /// critical, normal or low (the kind's default when absent).
    #[serde(default, deserialize_with = "priority_name")]
    #[schema(value_type = Option<PriorityName>)]
    priority: Option<Priority>,
    /// Recipients or signer accounts to order it in; the kind's plugin
    /// names them when absent.
    #[serde(default)]
    lanes: Vec<String>,
    /// Any JSON value (object, array, string, number, boolean or null);
    /// stored and sent byte for byte as given.
    #[schema(value_type = Value)]
    payload: Box<RawValue>,
    #[serde(default)]
    idempotency_key: Option<String>,
    #[serde(default)]
    coalesce_key: Option<String>,
    #[serde(default)]
    subject: Option<String>,
    #[serde(default)]
    correlation_id: Option<String>,
    /// Not before this many milliseconds from now.
    #[serde(default)]
    delay_ms: Option<u64>,
}

/// A priority by its name, with a refusal that says so (a number, the
/// SQL column's rank, is the likely mistake).
fn priority_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Priority>, D::Error> {
    use serde::de::Error as _;
    let expected = "expected \"critical\", \"normal\" or \"low\"";
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(name)) => match name.as_str() {
            "critical" => Ok(Some(Priority::Critical)),
            "normal" => Ok(Some(Priority::Normal)),
            "low" => Ok(Some(Priority::Low)),
            _ => Err(D::Error::custom(format!("priority: {expected}, got {name:?}"))),
        },
        Some(other) => Err(D::Error::custom(format!(
            "priority: {expected} (a name, not a number or other value), got {other}"
        ))),
    }
}

/// A priority tier, by name.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
pub(super) enum PriorityName {
    Critical,
    Normal,
    Low,
}

/// What `POST /api/v1/ops` takes: one op, or a batch of 1 to 1000 (all or
/// nothing). For the document only; the handler reads each shape itself.
#[derive(Deserialize, ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum EnqueueBody {
    One(OpBody),
    Batch(OpBatch),
}

/// A batch of ops.
#[derive(Deserialize, ToSchema)]
#[allow(dead_code)]
pub(super) struct OpBatch {
    /// 1 to 1000 ops, enqueued all or nothing.
    ops: Vec<OpBody>,
}

/// A single op, or `{"ops": [...]}`.
#[derive(Debug)]
enum Body {
    Batch { ops: Vec<OpBody> },
    One(Box<OpBody>),
}

/// Most seconds `?wait=` may hold a request.
const MAX_WAIT_SECONDS: f64 = 300.0;

/// `?wait=SECONDS`: hold the answer until the op is terminal.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct WaitQuery {
    /// Hold the answer up to this many seconds (one op only, ≤ 300) until
    /// the op is terminal: 200 with its outcome, or 202 if it is still on
    /// its way.
    wait: Option<f64>,
}

/// Enqueues one op, or a batch (`{"ops": [...]}`, all or nothing). An
/// `Idempotency-Key` header (or the field) makes a repeat answer the op
/// already made.
#[utoipa::path(post, path = "/api/v1/ops", tag = "producer",
    request_body(content = EnqueueBody, description = "One op, or `{\"ops\": [OpBody, ...]}` (1 to 1000, all or nothing)"),
    params(("Idempotency-Key" = Option<String>, Header, description = "One op's idempotency key"), WaitQuery),
    security(("bearer" = ["ops:write"])),
    responses(
        (status = 201, description = "`status: created`, `id`, `op`, and for a priced kind `estimate`", body = super::schemas::EnqueueAnswer),
        (status = 200, description = "`status: existing` (a repeated key: the op it made), or for a batch `results` in order; with `?wait=`, the op reached a terminal status: `outcome` ({status, attempts, receipt, last_error})", body = super::schemas::EnqueueResult),
        (status = 202, description = "With `?wait=`: the wait ended first; the op goes on (follow it in `/api/v1/outcomes`)", body = super::schemas::EnqueueAnswer),
        (status = 409, description = "`status: already_pending`: an op with this coalesce key is pending; or `code: idempotency_conflict`: the idempotency key already names an op of the outbox with another kind, payload or lanes. Nothing enqueued", body = Value),
        (status = 429, description = "`too_many_waiters`: too many `?wait=` requests are held; nothing enqueued", body = ErrorBody),
        (status = 422, description = "`unknown_kind`, `lanes_required`, `invalid_op`, `plugin_refused`", body = ErrorBody),
        Refusals, BodyRefusals,
    ))]
pub(super) async fn enqueue(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<WaitQuery>, QueryRejection>,
    body: Result<Json<Box<RawValue>>, JsonRejection>,
) -> Result<Response, ApiError> {
    let actor = state.authorize(&headers, "ops:write").await?;
    // A repeated idempotency key must not read back an op the caller may
    // not read: without outbox:read it answers the id and status only.
    let may_read = actor.may("outbox:read");
    let Query(WaitQuery { wait }) = query?;
    let wait = match wait {
        None => None,
        Some(w) if w > 0.0 && w <= MAX_WAIT_SECONDS => Some(std::time::Duration::from_secs_f64(w)),
        Some(w) => {
            return Err(ApiError::invalid(format!(
                "wait: expected more than 0 and at most {MAX_WAIT_SECONDS} seconds, got {w}"
            )))
        }
    };
    let Json(body) = body?;
    // Untagged enums hide why a body did not fit; parse the single shape
    // directly so its error names the field. Payloads stay raw text, so
    // they are stored exactly as sent (key order, big numbers).
    #[derive(Deserialize)]
    struct Probe {
        ops: Option<serde::de::IgnoredAny>,
    }
    let text = body.get();
    let batch = serde_json::from_str::<Probe>(text).is_ok_and(|p| p.ops.is_some());
    // (Raw payloads cannot pass through an untagged enum: serde buffers
    // its content, so each shape is parsed as itself.)
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Batch {
        ops: Vec<OpBody>,
    }
    let parsed: Body = if batch {
        let Batch { ops } = serde_json::from_str(text).map_err(|e| ApiError::invalid(format!("body: {e}")))?;
        Body::Batch { ops }
    } else {
        Body::One(Box::new(
            serde_json::from_str(text).map_err(|e| ApiError::invalid(format!("body: {e}")))?,
        ))
    };
    let header_key = match headers.get("idempotency-key") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key: expected visible ASCII"))?
                .to_owned(),
        ),
        None => None,
    };
    if batch && wait.is_some() {
        return Err(ApiError::invalid("wait applies to one op, not a batch"));
    }
    // Held before anything is written: a refused wait enqueues nothing.
    let waiter = match wait {
        Some(_) => Some(state.waiter().ok_or_else(|| {
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_waiters",
                "too many ?wait= requests are held just now; retry, or enqueue without wait and follow /api/v1/outcomes",
            )
        })?),
        None => None,
    };
    let bodies = match parsed {
        Body::One(mut one) => {
            if let Some(key) = header_key {
                if one.idempotency_key.as_ref().is_some_and(|k| *k != key) {
                    return Err(ApiError::invalid(
                        "the Idempotency-Key header and the idempotency_key field differ",
                    ));
                }
                one.idempotency_key = Some(key);
            }
            vec![*one]
        }
        Body::Batch { ops } => {
            if header_key.is_some() {
                return Err(ApiError::invalid(
                    "Idempotency-Key applies to one op; give each op of a batch its idempotency_key",
                ));
            }
            ops
        }
    };
    if bodies.is_empty() || bodies.len() > MAX_BATCH {
        return Err(ApiError::invalid(format!(
            "expected 1 to {MAX_BATCH} ops, got {}",
            bodies.len()
        )));
    }
    // A key limited to outboxes enqueues into those only (checked before
    // anything is prepared: a refused batch asks no plugin anything).
    for (i, body) in bodies.iter().enumerate() {
        actor
            .must_cover(&body.outbox)
            .map_err(|e| if batch { at_index(i, e) } else { e })?;
    }
    let config = state.dispatcher().config();
    let mut ops = Vec::with_capacity(bodies.len());
    for (i, body) in bodies.into_iter().enumerate() {
        let op = prepare(&state, body)
            .await
            .map_err(|e| if batch { at_index(i, e) } else { e })?;
        queue::validate_new_op(&op, config.limits()).map_err(|e| {
            let e = ApiError::from(e);
            if batch {
                at_index(i, e)
            } else {
                e
            }
        })?;
        ops.push(op);
    }
    // Nothing is written unless every op of the batch is valid.
    let results = state.dispatcher().enqueue(&ops).await?;
    let mut answers = Vec::with_capacity(results.len());
    for (op, result) in ops.iter().zip(&results) {
        answers.push(answer(&state, op, *result, may_read).await);
    }
    if batch {
        return Ok((StatusCode::OK, Json(json!({ "results": answers }))).into_response());
    }
    let mut status = match results.first() {
        Some(Enqueued::Created(_)) => StatusCode::CREATED,
        Some(Enqueued::Existing(_)) => StatusCode::OK,
        _ => StatusCode::CONFLICT,
    };
    let mut body = answers.pop().unwrap_or(Value::Null);
    if let (Some(wait), Some(Enqueued::Created(id) | Enqueued::Existing(id))) = (wait, results.first()) {
        match state.dispatcher().wait_terminal(*id, wait).await? {
            Some(op) => {
                status = StatusCode::OK;
                if may_read || matches!(results.first(), Some(Enqueued::Created(_))) {
                    body["outcome"] = json!({
                        "status": op.status, "attempts": op.attempts,
                        "receipt": op.receipt, "last_error": op.last_error,
                    });
                    body["op"] = json!(op);
                } else {
                    body["outcome"] = json!({ "status": op.status });
                }
            }
            None => status = StatusCode::ACCEPTED,
        }
    }
    drop(waiter);
    Ok((status, Json(body)).into_response())
}

fn at_index(i: usize, e: ApiError) -> ApiError {
    ApiError::new(e.status, e.code, format!("ops[{i}]: {}", e.message))
}

async fn prepare(state: &ApiState, body: OpBody) -> Result<NewOp, ApiError> {
    let config = state.dispatcher().config();
    let payload = body.payload.get().to_owned();
    let mut lanes = body.lanes;
    let has_plugin = config.kinds.get(&body.kind).is_some_and(|k| k.plugin.is_some());
    // A pool's kind is dealt its channel when it is enqueued, not here.
    let pooled = config.kinds.get(&body.kind).is_some_and(|k| k.pool.is_some());
    if lanes.is_empty() && has_plugin && !pooled {
        lanes = state
            .dispatcher()
            .executors()
            .lanes_for(&body.kind, &body.outbox, &payload)
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "plugin_refused",
                    format!("kind {}: the plugin refused the op: {e}", body.kind),
                )
            })?;
    }
    let not_before = match body.delay_ms {
        None => None,
        Some(ms) if ms <= MAX_DELAY_MS => enqueue::not_before(ms),
        Some(ms) => {
            return Err(ApiError::invalid(format!(
                "delay_ms: expected at most {MAX_DELAY_MS} (a year), got {ms}"
            )))
        }
    };
    let request = EnqueueRequest {
        kind: body.kind,
        outbox: body.outbox,
        priority: body.priority,
        lanes,
        payload,
        idempotency_key: body.idempotency_key,
        coalesce_key: body.coalesce_key,
        subject: body.subject,
        correlation_id: body.correlation_id,
        not_before,
    };
    Ok(enqueue::prepare(request, &config)?)
}

/// One op's answer: what happened, the op as stored, and for a new op of a
/// priced kind the fee estimate. An op that was already there (a repeated
/// idempotency or coalesce key) is shown whole only to a key that may read
/// ops (`outbox:read`); otherwise its id and status, so replaying someone
/// else's key reads nothing of their op.
async fn answer(state: &ApiState, op: &NewOp, result: Enqueued, may_read: bool) -> Value {
    let (status, id) = match result {
        Enqueued::Created(id) => ("created", id),
        Enqueued::Existing(id) => ("existing", id),
        Enqueued::AlreadyPending(id) => ("already_pending", id),
    };
    let stored = state.queue().get(id).await.ok().flatten();
    if !may_read && !matches!(result, Enqueued::Created(_)) {
        let mut answer = json!({
            "status": status, "id": id,
            "op": stored.as_ref().map(|o| json!({ "id": o.id, "status": o.status })),
        });
        if matches!(result, Enqueued::AlreadyPending(_)) {
            answer["error"] = json!({
                "code": "coalesced",
                "message": format!("op {id} with this coalesce key is already pending; nothing enqueued"),
            });
        }
        return answer;
    }
    let estimate = match result {
        Enqueued::Created(_) => state.dispatcher().estimate(&op.kind, op.priority).await.ok().flatten(),
        _ => None,
    };
    let mut answer = json!({ "status": status, "id": id, "op": stored });
    // A repeated key whose op was pruned answers from its tombstone.
    if let (Enqueued::Existing(_), None, Some(key)) = (result, &stored, &op.idempotency_key) {
        if let Ok(Some(tombstone)) = state.queue().tombstone(&op.outbox, key).await {
            answer["pruned"] = json!(tombstone);
        }
    }
    if let Some(estimate) = estimate {
        answer["estimate"] = json!(estimate);
    }
    if matches!(result, Enqueued::AlreadyPending(_)) {
        answer["error"] = json!({
            "code": "coalesced",
            "message": format!("op {id} with this coalesce key is already pending; nothing enqueued"),
        });
    }
    answer
}

use crate::fanout::MAX_RECIPIENTS;

/// An addressee: its inbox, or `{inbox, shared_inbox}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum RecipientBody {
    /// Just the actor's inbox.
    Inbox(String),
    /// The actor's inbox and its server's shared inbox.
    Actor {
        /// The actor's own inbox.
        inbox: String,
        /// The shared inbox, which de-duplicates deliveries to one server.
        #[serde(default)]
        shared_inbox: Option<String>,
    },
}

/// An activity and whom to deliver it to.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct DeliveriesBody {
    /// The executor kind; `activitypub` when absent.
    #[serde(default)]
    kind: Option<String>,
    /// The sending actor (the outbox the ops go in).
    outbox: String,
    /// The activity, stored and sent byte for byte as given (its `id`
    /// makes the fan-out idempotent per inbox).
    #[schema(value_type = Object)]
    activity: Box<RawValue>,
    /// One op per distinct delivery inbox (shared inboxes de-duplicate).
    recipients: Vec<RecipientBody>,
    /// critical, normal or low (the kind's default when absent).
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    priority: Option<Priority>,
    /// The user the deliveries act for.
    #[serde(default)]
    subject: Option<String>,
}

/// Fans an activity out: one op per distinct delivery inbox, each in that
/// inbox's lane, all or nothing.
#[utoipa::path(post, path = "/api/v1/activitypub/deliveries", tag = "producer",
    request_body = DeliveriesBody,
    security(("bearer" = ["ops:write"])),
    responses(
        (status = 200, description = "`deliveries` ({inbox, status: created|existing|already_pending, id}) in recipient order, and the count of each status", body = Value),
        (status = 422, description = "`unknown_kind`, `internal_kind`, `invalid_activity`, `invalid_op`", body = ErrorBody),
        Refusals, BodyRefusals,
    ))]
pub(super) async fn deliveries(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<DeliveriesBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let actor = state.authorize(&headers, "ops:write").await?;
    let Json(body) = body?;
    actor.must_cover(&body.outbox)?;
    if body.recipients.len() > MAX_RECIPIENTS {
        return Err(ApiError::invalid(format!(
            "recipients: expected at most {MAX_RECIPIENTS}, got {}",
            body.recipients.len()
        )));
    }
    let request = crate::fanout::FanOut {
        kind: body.kind.unwrap_or_else(|| "activitypub".to_owned()),
        actor: body.outbox,
        activity: body.activity.get().to_owned(),
        recipients: body
            .recipients
            .into_iter()
            .map(|r| match r {
                RecipientBody::Inbox(inbox) => crate::fanout::Recipient {
                    inbox,
                    shared_inbox: None,
                },
                RecipientBody::Actor { inbox, shared_inbox } => crate::fanout::Recipient { inbox, shared_inbox },
            })
            .collect(),
        priority: body.priority,
        subject: body.subject,
    };
    // The kind is looked up and the plan made once, inside the fan-out,
    // which refuses an unknown kind or a malformed activity before anything
    // is written (a 5,000-recipient plan parses the activity and
    // canonicalises every inbox: about 10 ms).
    let (results, planned) = state.dispatcher().fan_out(&request).await.map_err(|e| match e {
        crate::destinations::FanOutFailure::UnknownKind(why) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_kind", why)
        }
        crate::destinations::FanOutFailure::Activity(e) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_activity", e.to_string())
        }
        // The same code the enqueue route answers for laneway's own kinds.
        crate::destinations::FanOutFailure::InternalKind(why) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "internal_kind", why)
        }
        crate::destinations::FanOutFailure::Refused(why) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_op", why)
        }
        crate::destinations::FanOutFailure::Queue(e) => ApiError::from(e),
    })?;
    let ops = planned.ops;
    let mut counts = [0usize; 3];
    let deliveries: Vec<Value> = ops
        .iter()
        .zip(&results)
        .map(|(op, result)| {
            let (status, id, slot) = match *result {
                Enqueued::Created(id) => ("created", id, 0),
                Enqueued::Existing(id) => ("existing", id, 1),
                Enqueued::AlreadyPending(id) => ("already_pending", id, 2),
            };
            counts[slot] += 1;
            json!({ "inbox": op.lanes.first(), "status": status, "id": id })
        })
        .collect();
    Ok(Json(json!({
        "deliveries": deliveries,
        "created": counts[0], "existing": counts[1], "already_pending": counts[2],
        "skipped_gone": planned.gone,
    }))
    .into_response())
}
