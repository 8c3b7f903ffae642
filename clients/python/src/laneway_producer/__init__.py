"""Insert-only producer client for laneway: enqueue ops inside your own
database transaction, on your own connection (the transactional outbox).

    import psycopg, laneway_producer as lw

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (id) VALUES (%s)", ("o-17",))
        op_id = lw.enqueue(conn, kind="email", outbox="shop",
                           payload={"order": "o-17"}, lanes=["customer:c-3"],
                           idempotency_key="order-confirmed:o-17")

The same call takes a stdlib ``sqlite3.Connection`` on a file laneway
shares. Nothing here commits, rolls back or opens a connection: the op
commits or rolls back with your transaction. Every refusal is a typed
``LanewayError`` subclass (docs/producers.md lists them).
"""

from __future__ import annotations

import datetime as _dt
import json as _json
import re as _re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = [
    "CONTRACT_VERSION",
    "Op",
    "enqueue",
    "enqueue_many",
    "contract_version",
    "LanewayError",
    "InvalidOp",
    "UnknownKind",
    "LanesRequired",
    "PayloadTooLarge",
    "IdempotencyConflict",
    "InternalKind",
    "Conflict",
]

#: The producer contract version this client is written against.
CONTRACT_VERSION = 1

_PRIORITIES = {"critical": 0, "normal": 1, "low": 2}
_MAX_DELAY_MS = 31_536_000_000


class LanewayError(Exception):
    """laneway refused the op; nothing was written. ``code`` is the API's
    error code for the same refusal, ``sqlstate`` PostgreSQL's (or None)."""

    code = "laneway"

    def __init__(self, message: str, sqlstate: Optional[str] = None):
        super().__init__(message)
        self.sqlstate = sqlstate


class InvalidOp(LanewayError):
    """A field's type, size or emptiness (``LW001``)."""

    code = "invalid_op"


class UnknownKind(LanewayError):
    """No laneway host has the kind configured (``LW002``)."""

    code = "unknown_kind"


class LanesRequired(LanewayError):
    """The kind needs lanes and the op names none (``LW003``)."""

    code = "lanes_required"


class PayloadTooLarge(LanewayError):
    """The payload is over ``queue.max_payload_bytes`` (``LW004``)."""

    code = "payload_too_large"


class IdempotencyConflict(LanewayError):
    """The idempotency key already names another op of the outbox (``LW005``)."""

    code = "idempotency_conflict"


class InternalKind(LanewayError):
    """The kind is laneway's own (outcome webhooks, inbound activities)."""

    code = "internal_kind"


class Conflict(LanewayError):
    """A concurrent change got in the way; run the transaction again."""

    code = "conflict"


_BY_CODE = {
    c.code: c
    for c in (InvalidOp, UnknownKind, LanesRequired, PayloadTooLarge, IdempotencyConflict, InternalKind, Conflict)
}
_BY_SQLSTATE = {
    "LW001": InvalidOp,
    "LW002": UnknownKind,
    "LW003": LanesRequired,
    "LW004": PayloadTooLarge,
    "LW005": IdempotencyConflict,
    "40001": Conflict,
}
_MESSAGE = _re.compile(r"laneway: ([a-z_]+): ")


@dataclass
class Op:
    """One op, as ``enqueue`` takes it (docs/producers.md, "The fields")."""

    kind: str
    outbox: str
    payload: Any
    lanes: Sequence[str] = field(default_factory=list)
    priority: Optional[str] = None
    idempotency_key: Optional[str] = None
    coalesce_key: Optional[str] = None
    subject: Optional[str] = None
    correlation_id: Optional[str] = None
    delay_ms: Optional[int] = None
    not_before: Optional[_dt.datetime] = None


def enqueue(conn: Any, *, schema: str = "laneway", **fields: Any) -> int:
    """Enqueues one op in the caller's open transaction on ``conn`` (a
    psycopg 3 connection or cursor, or a ``sqlite3.Connection``); returns the
    id of the op that carries the intent (new, the one its idempotency key
    names, or the one its coalesce key has pending)."""
    return enqueue_many(conn, [Op(**fields)], schema=schema)[0]


def enqueue_many(conn: Any, ops: Iterable[Op | Mapping[str, Any]], *, schema: str = "laneway") -> list[int]:
    """Enqueues several ops, all or nothing (on PostgreSQL one call of
    ``laneway.enqueue_many``, which locks their outboxes in laneway's order);
    their ids in order."""
    ops = [op if isinstance(op, Op) else Op(**op) for op in ops]
    if not ops:
        return []
    for op in ops:
        _check(op)
    if _is_sqlite(conn):
        return [_sqlite_enqueue(conn, op) for op in ops]
    return _pg_enqueue_many(conn, ops, schema)


def contract_version(conn: Any, *, schema: str = "laneway") -> int:
    """The producer contract version the database carries."""
    if _is_sqlite(conn):
        row = conn.execute("SELECT version FROM laneway_contract WHERE id = 1").fetchone()
    else:
        row = conn.execute(f"SELECT {_ident(schema)}.contract_version()").fetchone()
    return int(row[0])


# --- checks the database would make too, made first for a clearer error ---


def _check(op: Op) -> None:
    for name in ("kind", "outbox"):
        if not isinstance(getattr(op, name), str):
            raise InvalidOp(f"{name} must be a str, got {type(getattr(op, name)).__name__}")
    for name in ("idempotency_key", "coalesce_key", "subject", "correlation_id", "priority"):
        value = getattr(op, name)
        if value is not None and not isinstance(value, str):
            # A bytes key stored as a BLOB once stopped a whole outbox.
            raise InvalidOp(f"{name} must be a str or None, got {type(value).__name__}")
    if isinstance(op.lanes, (str, bytes)) or not all(isinstance(l, str) for l in op.lanes):
        raise InvalidOp("lanes must be a list of str")
    if op.priority is not None and op.priority not in _PRIORITIES:
        raise InvalidOp(f"priority must be 'critical', 'normal' or 'low' (or None), got {op.priority!r}")
    if op.delay_ms is not None and (
        isinstance(op.delay_ms, bool) or not isinstance(op.delay_ms, int) or not 0 <= op.delay_ms <= _MAX_DELAY_MS
    ):
        raise InvalidOp(f"delay_ms is milliseconds from now, 0 to {_MAX_DELAY_MS}, got {op.delay_ms!r}")
    if op.not_before is not None and (not isinstance(op.not_before, _dt.datetime) or op.not_before.tzinfo is None):
        raise InvalidOp("not_before must be a timezone-aware datetime")


def _payload_text(op: Op) -> str:
    if isinstance(op.payload, (bytes, bytearray)):
        raise InvalidOp("payload must be JSON-serialisable data (or a str of JSON text via json.loads first), not bytes")
    try:
        return _json.dumps(op.payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidOp(f"payload is not JSON-serialisable: {e}") from e


def _typed(e: Exception) -> LanewayError | None:
    sqlstate = getattr(e, "sqlstate", None)
    message = str(getattr(getattr(e, "diag", None), "message_primary", None) or e)
    m = _MESSAGE.search(message)
    cls = (m and _BY_CODE.get(m.group(1))) or _BY_SQLSTATE.get(sqlstate or "")
    if cls is None and "producers cannot enqueue it" in message:
        cls = InternalKind
    if cls is None:
        return None
    text = message[m.start():] if m else message
    return cls(text, sqlstate)


# --- PostgreSQL (psycopg 3) ---


def _ident(schema: str) -> str:
    if not _re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
        raise InvalidOp(f"schema must be a plain lower-case name, got {schema!r}")
    return schema


def _pg_enqueue_many(conn: Any, ops: list[Op], schema: str) -> list[int]:
    body = []
    for op in ops:
        item: dict[str, Any] = {"kind": op.kind, "outbox": op.outbox, "payload": _json.loads(_payload_text(op))}
        if op.lanes:
            item["lanes"] = list(op.lanes)
        for name in ("priority", "idempotency_key", "coalesce_key", "subject", "correlation_id", "delay_ms"):
            if getattr(op, name) is not None:
                item[name] = getattr(op, name)
        if op.not_before is not None:
            item["not_before"] = op.not_before.isoformat()
        body.append(item)
    try:
        rows = conn.execute(
            f"SELECT id FROM {_ident(schema)}.enqueue_many(%s::jsonb) AS id", (_json.dumps(body),)
        ).fetchall()
    except Exception as e:  # psycopg.Error, re-raised typed when it is laneway's
        typed = _typed(e)
        if typed is None:
            raise
        raise typed from e
    return [int(r[0]) for r in rows]


# --- SQLite (stdlib sqlite3): the contract's table, checked by its triggers ---


def _is_sqlite(conn: Any) -> bool:
    return type(conn).__module__.startswith(("sqlite3", "_sqlite3"))


def _sqlite_enqueue(conn: Any, op: Op) -> int:
    now_ms = int(_dt.datetime.now(_dt.timezone.utc).timestamp() * 1000)
    due = now_ms + (op.delay_ms or 0)
    if op.not_before is not None:
        due = max(due, int(op.not_before.timestamp() * 1000))
    columns = {
        "kind": op.kind,
        "outbox": op.outbox,
        "payload": _payload_text(op),
        "lanes": _json.dumps(list(op.lanes), ensure_ascii=False),
        "idempotency_key": op.idempotency_key,
        "coalesce_key": op.coalesce_key,
        "subject": op.subject,
        "correlation_id": op.correlation_id,
        "next_attempt_at": due,
    }
    if op.priority is not None:
        columns["priority"] = _PRIORITIES[op.priority]
    names = ", ".join(columns)
    marks = ", ".join("?" for _ in columns)
    import sqlite3

    try:
        row = conn.execute(
            f"INSERT INTO laneway_ops ({names}) VALUES ({marks}) ON CONFLICT DO NOTHING RETURNING id",
            tuple(columns.values()),
        ).fetchone()
    except sqlite3.DatabaseError as e:
        typed = _typed(e)
        if typed is None:
            raise
        raise typed from e
    if row is not None:
        return int(row[0])
    # Not inserted: the op its key names (live, or pruned: a tombstone), or
    # the one its coalesce key has pending.
    lookups = []
    if op.idempotency_key is not None:
        lookups += [
            ("SELECT id FROM laneway_ops WHERE outbox = ? AND idempotency_key = ?", (op.outbox, op.idempotency_key)),
            (
                "SELECT op_id FROM laneway_idempotency_tombstones WHERE outbox = ? AND idempotency_key = ?",
                (op.outbox, op.idempotency_key),
            ),
        ]
    if op.coalesce_key is not None:
        lookups.append(
            (
                "SELECT id FROM laneway_ops WHERE outbox = ? AND coalesce_key = ? AND status IN ('pending', 'submitted')",
                (op.outbox, op.coalesce_key),
            )
        )
    for sql, args in lookups:
        found = conn.execute(sql, args).fetchone()
        if found is not None:
            return int(found[0])
    raise Conflict("laneway: conflict: the op conflicted with a concurrent change; run the transaction again")
