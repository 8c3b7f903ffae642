//! The durable queue: one [`Queue`] trait, two backends (SQLite embedded,
//! PostgreSQL shared by several hosts), and the only place in laneway that
//! issues SQL.
//!
//! Every op stays in the database until it reaches a terminal state. A claim
//! is a committed `submitted` row carrying a lease (owner, token, expiry); no
//! transaction is held open while an op is delivered. Every change a
//! dispatcher makes is a compare-and-set on the status, attempt number and
//! lease token it claimed with, so a stale dispatcher can never overwrite a
//! newer state. Operator changes are a compare-and-set on the status.

mod codec;
mod dialect;
mod operator;
mod policy;
pub mod postgres;
mod settings;
mod sql;
pub mod sqlite;
mod traits;
mod types;

use std::sync::Arc;

use serde::Serialize;
use uuid::Uuid;

use crate::clock::Clock;
use crate::op::{IllegalTransition, OpId};

pub use operator::{
    ApiKey, AuditEntry, FeedFilter, Latency, NewApiKey, NewAuditEntry, OldestDue, OutcomeEntry, Pause, PauseScope,
    PruneQuery, QueueGauges, Tombstone,
};
pub use policy::{validate_new_op, validate_new_ops, MAX_LANES_PER_OP};
pub use postgres::{check_schema_name, DEFAULT_SCHEMA};
pub use settings::{DatabaseConfig, SqliteConfig, Synchronous};
pub use traits::{DispatchStore, OpStore, OperatorStore, Queue, RecordStore, RetentionStore};
pub use types::*;

/// Every part of the queue's interface, for callers that use many.
pub mod prelude {
    pub use super::{DispatchStore, OpStore, OperatorStore, Queue, RecordStore, RetentionStore};
}

impl From<sqlx::Error> for QueueError {
    /// A value the database refuses (PostgreSQL's data exceptions: a NUL
    /// byte in text, a date out of its range; the internal-kind trigger; the
    /// producer contract's checks, `laneway: CODE: …`) is the caller's bad
    /// input, the same on both backends, not an outage.
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            if let Some(refusal) = contract_refusal(db.message()) {
                return refusal;
            }
            // PostgreSQL's lock_timeout (55P03); SQLite's busy and locked.
            let busy = match db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                Some(pg) => pg.code() == "55P03",
                None => db
                    .code()
                    .is_some_and(|c| c == "5" || c == "6" || c == "261" || c == "517"),
            };
            if busy {
                return QueueError::Busy(format!(
                    "another transaction held a lock laneway needed past its bound ({}): on PostgreSQL most \
                     often a producer's transaction that is inserting the same idempotency key and has not committed, \
                     on SQLite any other write transaction on the file; retry, and keep such transactions short",
                    db.message()
                ));
            }
            if refused_value(db.as_ref()) || db.message().contains("producers cannot enqueue it") {
                return QueueError::InvalidOp(format!("the database refused a value: {}", db.message()));
            }
        }
        if matches!(e, sqlx::Error::PoolTimedOut) {
            return QueueError::Busy(
                "no database connection came free within [database] connect_timeout_ms: every one was busy \
                 (on SQLite, another process's write transaction may hold the file's write lock) or the \
                 database did not answer; retry"
                    .to_owned(),
            );
        }
        QueueError::Database(e)
    }
}

/// Whether the database refused what was written rather than failed: a
/// value is bad input however deep in the database it was caught, so it is
/// never answered as an outage (a client retries an outage for ever).
/// PostgreSQL: data exceptions (22…: a NUL byte, a date out of range), a
/// CHECK or NOT NULL constraint (23514, 23502), a statement past a limit
/// (54…: too deep, too complex). SQLite: a CHECK or NOT NULL constraint
/// (extended codes 275, 1299), a value too big (18), JSON its functions
/// refuse (plain errors saying so).
fn refused_value(db: &dyn sqlx::error::DatabaseError) -> bool {
    let Some(code) = db.code() else {
        return false;
    };
    if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() {
        return code.starts_with("22") || code.starts_with("54") || code == "23514" || code == "23502";
    }
    matches!(code.as_ref(), "275" | "1299" | "18")
        || (code == "1" && (db.message().contains("JSON") || db.message().contains("json")))
}

/// The producer contract's refusal in a database message (its triggers
/// raise `laneway: CODE: what to change` on both backends), if it is one.
fn contract_refusal(message: &str) -> Option<QueueError> {
    let rest = message.strip_prefix("laneway: ")?;
    let (code, text) = rest.split_once(": ")?;
    match code {
        "idempotency_conflict" => Some(QueueError::IdempotencyConflict(text.to_owned())),
        "invalid_op" | "unknown_kind" | "lanes_required" | "payload_too_large" | "internal_kind" => {
            Some(QueueError::InvalidOp(format!("{code}: {text}")))
        }
        _ => None,
    }
}

/// Which database a queue lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Embedded, one file, one machine.
    Sqlite,
    /// Shared by several hosts.
    Postgres,
}

impl Backend {
    /// The backend a database URL names (`sqlite:…`, `postgres://…` or
    /// `postgresql://…`), the one reading of URLs for the queue and
    /// `check-config` alike.
    pub fn from_url(url: &str) -> Option<Self> {
        if url.starts_with("sqlite:") {
            Some(Self::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Self::Postgres)
        } else {
            None
        }
    }
}

/// Errors from the queue layer. Variants name decisions a caller makes.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The database could not be reached or opened.
    #[error("cannot open database {url}: {source}")]
    Unreachable {
        /// The URL with any password removed.
        url: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The URL names no backend laneway supports.
    #[error("unsupported database url {0:?} (expected sqlite:… or postgres://…)")]
    UnsupportedUrl(String),
    /// The schema is older than this laneway; `laneway migrate` fixes it.
    #[error("database schema is behind this laneway (missing migration {missing}); run `laneway migrate`")]
    SchemaBehind {
        /// The first migration version not applied.
        missing: i64,
    },
    /// The schema was written by a newer laneway; this one must not touch it.
    #[error("database schema version {found} is newer than this laneway knows ({known}); upgrade laneway")]
    SchemaTooNew {
        /// The newest version applied to the database.
        found: i64,
        /// The newest version this binary carries.
        known: i64,
    },
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The op is malformed; nothing was written.
    #[error("invalid op: {0}")]
    InvalidOp(String),
    /// The idempotency key already names an op of the outbox with another
    /// kind, payload or lanes; nothing was written.
    #[error("{0}")]
    IdempotencyConflict(String),
    /// A lock or a connection laneway needed stayed taken past its bound
    /// (`lock_timeout_ms`, `busy_timeout_ms`, `connect_timeout_ms`);
    /// nothing changed, and the same call may succeed when tried again.
    #[error("database busy: {0}")]
    Busy(String),
    /// No op has that id.
    #[error("op {0} not found")]
    NotFound(OpId),
    /// An operator action the op's status does not allow.
    #[error("op {id}: {source}")]
    Illegal {
        /// The op.
        id: OpId,
        /// Why.
        #[source]
        source: IllegalTransition,
    },
    /// The op carries a receipt in doubt: its side effect may have happened,
    /// so it cannot be cancelled; its executor reconciles it first.
    #[error("op {0}: an earlier attempt may have taken effect (its receipt is in doubt); it is reconciled on its next attempt and cannot be cancelled")]
    InDoubt(OpId),
    /// A feed cursor this backend did not hand out.
    #[error("cursor {0:?} is not one this queue handed out")]
    BadCursor(String),
    /// An API key of that name exists already.
    #[error("an API key named {0:?} already exists")]
    KeyNameTaken(String),
    /// The change conflicts with another op or a concurrent writer.
    #[error("op {id}: {message}")]
    Conflict {
        /// The op (0 when it was never written).
        id: OpId,
        /// What conflicted.
        message: String,
    },
    /// A row holds a value no laneway writes (hand-edited, or corrupt).
    #[error("op {id} has an unreadable {column}: {value:?}")]
    Corrupt {
        /// The op.
        id: OpId,
        /// The column.
        column: &'static str,
        /// What was found.
        value: String,
    },
    /// A shared record holds a value no laneway writes.
    #[error("record {namespace}/{key} is unreadable: {why}")]
    BadRecord {
        /// Its namespace.
        namespace: &'static str,
        /// Its key.
        key: String,
        /// Why.
        why: String,
    },
    /// A shared record kept changing under every compare-and-set tried.
    #[error("{0}")]
    RecordContended(String),
    /// Any other database failure; the operation had no effect.
    #[error("database error: {0}")]
    Database(sqlx::Error),
}

/// What becomes of a shared record in [`update_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Leave it as it is (nothing is written).
    Keep,
    /// Store this JSON value.
    Put(String),
    /// Delete it.
    Delete,
}

/// Reads the record (namespace, key), asks `decide` what becomes of it and
/// writes that by compare-and-set on the version read, reading again and
/// asking again when another writer got there first. Returns what `decide`
/// answered with the change that was written (or kept), or `None` after
/// `tries` lost races. The one read-decide-write loop over shared records.
///
/// # Errors
///
/// A queue error, or what `decide` refuses.
pub async fn update_record<R>(
    queue: &dyn RecordStore,
    namespace: &str,
    key: &str,
    tries: usize,
    mut decide: impl FnMut(Option<&Record>) -> Result<(Change, R), QueueError>,
) -> Result<Option<R>, QueueError> {
    for _ in 0..tries {
        let stored = queue.record(namespace, key).await?;
        let (change, answer) = decide(stored.as_ref())?;
        let expect = stored.as_ref().map_or(Expect::Absent, |r| Expect::Version(r.version));
        let written = match change {
            Change::Keep => return Ok(Some(answer)),
            Change::Put(value) => queue.put_record(namespace, key, &value, expect).await?,
            Change::Delete => queue.delete_record(namespace, key, expect).await?,
        };
        if written.applied() {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}

/// Opens the queue named by the config's database URL.
///
/// # Errors
///
/// [`QueueError::UnsupportedUrl`] or [`QueueError::Unreachable`].
pub async fn open(
    config: &DatabaseConfig,
    limits: Limits,
    clock: Arc<dyn Clock>,
) -> Result<Arc<dyn Queue>, QueueError> {
    match Backend::from_url(&config.url) {
        Some(Backend::Sqlite) => Ok(Arc::new(sqlite::SqliteQueue::open(config, limits, clock).await?)),
        Some(Backend::Postgres) => Ok(Arc::new(postgres::PgQueue::open(config, limits, clock).await?)),
        None => Err(QueueError::UnsupportedUrl(redact_url(&config.url))),
    }
}

/// A fresh lease token.
pub(crate) fn new_token() -> Uuid {
    Uuid::new_v4()
}

/// The URL with any password replaced, for error messages and logs.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some(parts) => parts,
        None => ("", url),
    };
    // The user info runs to the last `@` (a password may hold an `@`, `/`
    // or `?` unencoded); the query is after the first `?` past it.
    let (creds, after) = match rest.rsplit_once('@') {
        Some((creds, after)) => (Some(creds), after),
        None => (None, rest),
    };
    let (location, query) = match after.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (after, None),
    };
    let mut out = String::new();
    if !scheme.is_empty() {
        out.push_str(scheme);
        out.push_str("://");
    }
    if let Some(creds) = creds {
        match creds.split_once(':') {
            Some((user, _)) => out.push_str(&format!("{user}:***@")),
            None => out.push_str(&format!("{creds}@")),
        }
    }
    out.push_str(location);
    if let Some(query) = query {
        let secret = |key: &str| {
            let key = key.to_ascii_lowercase();
            ["pass", "secret", "token", "key"].iter().any(|s| key.contains(s))
        };
        let params: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if secret(key) => format!("{key}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contracts_refusals_are_the_callers_mistakes_and_nothing_else_is() {
        let refused = |m: &str| contract_refusal(m).map(|e| e.to_string());
        assert_eq!(
            refused("laneway: idempotency_conflict: key 'k' already names an op"),
            Some("key 'k' already names an op".to_owned())
        );
        for code in [
            "invalid_op",
            "unknown_kind",
            "lanes_required",
            "payload_too_large",
            "internal_kind",
        ] {
            let e = contract_refusal(&format!("laneway: {code}: change this"));
            assert!(
                matches!(&e, Some(QueueError::InvalidOp(m)) if m == &format!("{code}: change this")),
                "{code}: {e:?}"
            );
        }
        // laneway's own guards (an op's identity is immutable) are not a
        // producer's refusal, nor is anything else the database says.
        for other in [
            "laneway: an op's outbox, kind, lanes, payload and idempotency key are immutable",
            "laneway: nonsense_code: x",
            "database is locked",
            "",
        ] {
            assert!(contract_refusal(other).is_none(), "{other}");
        }
    }

    #[test]
    fn a_host_hands_back_what_it_holds_beyond_an_even_share() {
        let share = |hosts, slots, mine| HostShare { hosts, slots, mine }.excess();
        assert_eq!(share(1, 3, 3), 0, "alone, a host keeps everything");
        assert_eq!(share(2, 3, 3), 1, "two hosts, three slots: 2 and 1");
        assert_eq!(share(2, 3, 2), 0);
        assert_eq!(share(3, 3, 3), 2);
        assert_eq!(share(2, 4, 1), 0, "under its share, nothing to give");
        assert_eq!(share(3, 0, 0), 0);
    }

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(redact_url("postgres://u:pw@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("sqlite://laneway.db"), "sqlite://laneway.db");
        assert_eq!(redact_url("postgres://u:p@ss@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact_url("postgres://u:a/b?c@h/db"), "postgres://u:***@h/db");
        assert_eq!(
            redact_url("postgres://h/db?user=u&password=pw&sslmode=require&sslpassword=x"),
            "postgres://h/db?user=u&password=***&sslmode=require&sslpassword=***"
        );
        assert_eq!(redact_url("sqlite://x.db?mode=rwc"), "sqlite://x.db?mode=rwc");
    }

    #[test]
    fn enqueued_reports_the_op_to_track() {
        assert_eq!(Enqueued::Created(3).id(), 3);
        assert_eq!(Enqueued::Existing(4).id(), 4);
        assert_eq!(Enqueued::AlreadyPending(5).id(), 5);
    }
}
