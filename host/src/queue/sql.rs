//! The queue's SQL: `sql/<dialect>/<area>.sql`, named blocks made constants
//! by `host/build.rs` (`sql::sqlite::dispatch::CLAIM`). The two dialects hold
//! the same names in the same order, so `diff -r sql/sqlite sql/postgres` is
//! the whole statement-level difference between the backends; a statement
//! one dialect does not need is a `-- none: name: why` line in its place.

include!(concat!(env!("OUT_DIR"), "/queue_sql.rs"));
