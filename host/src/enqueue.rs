//! Enqueue requests.
