//! CLI tests (filled in with the CLI).
