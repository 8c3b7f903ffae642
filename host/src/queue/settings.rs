//! The queue's own settings (`[database]`, `[database.sqlite]`): the queue
//! owns them, so it depends on no other part of laneway's configuration;
//! `config` reads them from the file with everything else.

use serde::Deserialize;

/// `[database]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DatabaseConfig {
    /// `sqlite:FILE` or `postgres://…`.
    pub url: String,
    /// Pool size (PostgreSQL) or reader connections (SQLite).
    pub max_connections: u32,
    /// Connection acquire timeout.
    pub connect_timeout_ms: u64,
    /// PostgreSQL: the schema laneway's tables, functions and triggers live
    /// in, apart from the application's own (`laneway` when neither this
    /// nor a `search_path` in the URL's `options` names one).
    #[serde(default)]
    pub schema: Option<String>,
    /// PostgreSQL: how long an enqueue through laneway (the API, the CLI)
    /// waits for a lock another transaction holds (a producer's open
    /// transaction on the same outbox) before it is answered busy.
    pub lock_timeout_ms: u64,
    /// SQLite-only settings.
    pub sqlite: SqliteConfig,
}

/// `[database.sqlite]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SqliteConfig {
    /// Durability of a commit.
    pub synchronous: Synchronous,
    /// Write-lock wait per connection.
    pub busy_timeout_ms: u64,
    /// How often a running host looks for commits by other processes, whose
    /// enqueues then wake it (SQLite has no `NOTIFY`); 0 leaves them to the
    /// poll.
    pub watch_ms: u64,
}

/// SQLite `synchronous` levels laneway allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// Durable through power loss.
    Full,
    /// Durable through a process crash only.
    Normal,
}
