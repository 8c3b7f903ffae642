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
