//! Where laneway lives in a PostgreSQL database: a schema of its own
//! (`[database] schema`, `laneway` by default), so its tables never meet
//! an application's `ops` or `api_keys`, every connection's `search_path`
//! names it, and `laneway migrate` creates it and moves a laneway that was
//! installed before schemas (in `public`) into it, whole and in one
//! transaction.

use sqlx::migrate::Migrator;
use sqlx::Connection;

use super::Conn;
use crate::queue::QueueError;

/// The schema when neither the config nor the URL names one.
pub const DEFAULT_SCHEMA: &str = "laneway";

/// The tables laneway's migrations made before schemas, every one of which
/// moves with its indexes, constraints, triggers and owned sequences.
const TABLES: [&str; 20] = [
    "ops",
    "op_lanes",
    "attempts",
    "fee_snapshots",
    "drain_slots",
    "kind_defaults",
    "hosts",
    "api_keys",
    "audit_log",
    "pauses",
    "halted_subjects",
    "lane_halts",
    "outcomes",
    "idempotency_tombstones",
    "singletons",
    "feed_cursors",
    "payloads",
    "records",
    "lane_occupants",
    "lane_redeals",
];

/// A schema name laneway accepts: it goes into `search_path` and DDL
/// unquoted-safe, so lower-case letters, digits and `_` only.
///
/// # Errors
///
/// What is wrong with it, for check-config.
pub fn check_schema_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || name.len() > 63 || name.starts_with("pg_") {
        return Err(format!(
            "expected a schema name of 1 to 63 lower-case letters, digits and _ (not starting with a digit or pg_), \
             got {name:?}"
        ));
    }
    Ok(())
}

/// The schema a URL's `options` put first in `search_path`
/// (`options=-c search_path=NAME`, percent-encoded or not), if any.
pub fn url_search_path(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let options = parsed.query_pairs().find(|(k, _)| k == "options")?.1.into_owned();
    let at = options.find("search_path=")?;
    let value = options[at + "search_path=".len()..].split_whitespace().next()?;
    let first = value.split(',').next()?.trim_matches('"');
    (!first.is_empty()).then(|| first.to_owned())
}

/// The schema laneway uses for this config.
pub fn resolve(configured: Option<&str>, url: &str) -> String {
    configured
        .map(str::to_owned)
        .or_else(|| url_search_path(url))
        .unwrap_or_else(|| DEFAULT_SCHEMA.to_owned())
}

/// Creates the schema, and moves a laneway installed in `public` before
/// schemas into it (only when `public` holds laneway's own migration
/// history, checked by checksum, and the schema has none yet). One
/// transaction: it moves whole or not at all. Hosts migrating at once take
/// turns.
pub async fn prepare(conn: &mut Conn, schema: &str, migrator: &Migrator) -> Result<(), QueueError> {
    check_schema_name(schema).map_err(QueueError::InvalidOp)?;
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('laneway.schema'))")
        .execute(&mut *tx)
        .await?;
    // Asked first: IF NOT EXISTS would log a notice on every migrate.
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(&mut *tx)
        .await?;
    if !exists {
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut *tx)
            .await?;
    }
    if schema != "public" && legacy_install(&mut tx, schema, migrator).await? {
        adopt(&mut tx, schema, migrator).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Whether `public` holds a laneway from before schemas that this schema
/// should take over.
async fn legacy_install(conn: &mut Conn, schema: &str, migrator: &Migrator) -> Result<bool, QueueError> {
    let ours: bool = sqlx::query_scalar(
        "SELECT to_regclass(format('%I._sqlx_migrations', $1::text)) IS NULL \
         AND to_regclass('public._sqlx_migrations') IS NOT NULL AND to_regclass('public.ops') IS NOT NULL",
    )
    .bind(schema)
    .fetch_one(&mut *conn)
    .await?;
    if !ours {
        return Ok(false);
    }
    let Some(first) = migrator.iter().next() else {
        return Ok(false);
    };
    let checksum: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checksum FROM public._sqlx_migrations WHERE version = $1 AND success")
            .bind(first.version)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(checksum.is_some_and(|c| c == first.checksum.as_ref()))
}

/// Moves laneway's tables, functions and migration history from `public`.
async fn adopt(conn: &mut Conn, schema: &str, migrator: &Migrator) -> Result<(), QueueError> {
    for table in TABLES {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass(format('public.%I', $1::text)) IS NOT NULL")
            .bind(table)
            .fetch_one(&mut *conn)
            .await?;
        if exists {
            sqlx::query(&format!("ALTER TABLE public.{table} SET SCHEMA {schema}"))
                .execute(&mut *conn)
                .await?;
        }
    }
    let functions: Vec<String> = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p \
         WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'laneway\\_%'",
    )
    .fetch_all(&mut *conn)
    .await?;
    for function in functions {
        // regprocedure prints public's functions qualified or not by the
        // search_path; either names the one function.
        sqlx::query(&format!("ALTER FUNCTION {function} SET SCHEMA {schema}"))
            .execute(&mut *conn)
            .await?;
    }
    // The history: the table itself when only laneway wrote it, else
    // laneway's rows copied out of an application's shared one.
    let known: Vec<i64> = migrator.iter().map(|m| m.version).collect();
    let foreign: i64 = sqlx::query_scalar("SELECT count(*) FROM public._sqlx_migrations WHERE version <> ALL($1)")
        .bind(&known)
        .fetch_one(&mut *conn)
        .await?;
    if foreign == 0 {
        sqlx::query(&format!("ALTER TABLE public._sqlx_migrations SET SCHEMA {schema}"))
            .execute(&mut *conn)
            .await?;
    } else {
        sqlx::query(&format!(
            "CREATE TABLE {schema}._sqlx_migrations (LIKE public._sqlx_migrations INCLUDING ALL)"
        ))
        .execute(&mut *conn)
        .await?;
        sqlx::query(&format!(
            "INSERT INTO {schema}._sqlx_migrations SELECT * FROM public._sqlx_migrations WHERE version = ANY($1)"
        ))
        .bind(&known)
        .execute(&mut *conn)
        .await?;
        sqlx::query("DELETE FROM public._sqlx_migrations WHERE version = ANY($1)")
            .bind(&known)
            .execute(&mut *conn)
            .await?;
    }
    tracing::info!(
        schema,
        "Moved laneway's tables and functions from public into their own schema."
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_comes_from_the_config_then_the_url_then_the_default() {
        let url = "postgres://u@h/db?options=-c%20search_path%3Dmine";
        assert_eq!(resolve(Some("set"), url), "set");
        assert_eq!(resolve(None, url), "mine");
        assert_eq!(resolve(None, "postgres://u@h/db?options=-c search_path=a,public"), "a");
        assert_eq!(resolve(None, "postgres://u@h/db"), "laneway");
        assert_eq!(resolve(None, "postgres://u@h/db?sslmode=disable"), "laneway");
    }

    #[test]
    fn only_plain_lower_case_names_are_schemas() {
        for good in ["laneway", "lw_2", "_x"] {
            assert!(check_schema_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Laneway",
            "2lw",
            "lw-x",
            "a b",
            "pg_temp",
            "x;drop",
            &"a".repeat(64),
        ] {
            assert!(check_schema_name(bad).is_err(), "{bad}");
        }
    }
}
