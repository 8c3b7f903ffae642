// Insert-only producer client for laneway: enqueue ops inside your own
// database transaction, on your own connection (the transactional outbox).
// PostgreSQL through `pg` (a Client or PoolClient with a transaction open),
// SQLite through `better-sqlite3` (inside `db.transaction(...)` or an
// explicit BEGIN IMMEDIATE). Nothing here commits or rolls back: the op
// goes with your transaction. The contract: docs/producers.md.

/** The producer contract version this client is written against. */
export const CONTRACT_VERSION = 1;

export type Priority = "critical" | "normal" | "low";

/** Any JSON value. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** One op (docs/producers.md, "The fields"). */
export interface Op {
  kind: string;
  outbox: string;
  /** Any JSON value; sent as JSON text. */
  payload: Json;
  /** Recipients or signer accounts the op is ordered in. */
  lanes?: string[];
  /** Default: the kind's configured priority. */
  priority?: Priority;
  idempotencyKey?: string;
  coalesceKey?: string;
  subject?: string;
  correlationId?: string;
  /** Milliseconds from now before the first attempt (0 to a year). */
  delayMs?: number;
  /** The earliest first attempt. */
  notBefore?: Date;
}

export interface Options {
  /** laneway's PostgreSQL schema (`[database] schema`), `laneway` by default. */
  schema?: string;
}

/** A `pg` Client or PoolClient. */
export interface PgQueryable {
  query(text: string, values?: unknown[]): Promise<{ rows: Array<Record<string, unknown>> }>;
}

/** A `better-sqlite3` Database. */
export interface SqliteDatabase {
  prepare(sql: string): {
    get(...params: unknown[]): unknown;
  };
  pragma: unknown;
}

/** laneway refused the op; nothing was written. */
export class LanewayError extends Error {
  /** The HTTP API's code for the same refusal. */
  readonly code: string;
  /** PostgreSQL's SQLSTATE, when the database said. */
  readonly sqlstate?: string;
  constructor(code: string, message: string, sqlstate?: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "LanewayError";
    this.code = code;
    this.sqlstate = sqlstate;
  }
}

const CODES = new Set([
  "invalid_op",
  "unknown_kind",
  "lanes_required",
  "payload_too_large",
  "idempotency_conflict",
  "internal_kind",
  "conflict",
]);
const SQLSTATES: Record<string, string> = {
  LW001: "invalid_op",
  LW002: "unknown_kind",
  LW003: "lanes_required",
  LW004: "payload_too_large",
  LW005: "idempotency_conflict",
  "40001": "conflict",
};
const PRIORITIES: Record<Priority, number> = { critical: 0, normal: 1, low: 2 };
const MAX_DELAY_MS = 31_536_000_000;

function invalid(message: string): LanewayError {
  return new LanewayError("invalid_op", `laneway: invalid_op: ${message}`);
}

/** The same checks the database makes, first, for a clearer error. */
function check(op: Op): void {
  if (typeof op !== "object" || op === null) throw invalid("an op is an object");
  for (const name of ["kind", "outbox"] as const) {
    if (typeof op[name] !== "string") throw invalid(`${name} must be a string`);
  }
  for (const name of ["idempotencyKey", "coalesceKey", "subject", "correlationId"] as const) {
    const v = op[name];
    if (v !== undefined && v !== null && typeof v !== "string") throw invalid(`${name} must be a string`);
  }
  if (op.lanes !== undefined && (!Array.isArray(op.lanes) || !op.lanes.every((l) => typeof l === "string"))) {
    throw invalid("lanes must be an array of strings");
  }
  if (op.priority !== undefined && !(op.priority in PRIORITIES)) {
    throw invalid(`priority must be "critical", "normal" or "low", got ${JSON.stringify(op.priority)}`);
  }
  if (op.delayMs !== undefined && (!Number.isInteger(op.delayMs) || op.delayMs < 0 || op.delayMs > MAX_DELAY_MS)) {
    throw invalid(`delayMs is milliseconds from now, 0 to ${MAX_DELAY_MS}`);
  }
  if (op.notBefore !== undefined && !(op.notBefore instanceof Date && !Number.isNaN(op.notBefore.getTime()))) {
    throw invalid("notBefore must be a valid Date");
  }
  if (op.payload === undefined) throw invalid("payload is required (null is a JSON value)");
}

function payloadText(op: Op): string {
  const text = JSON.stringify(op.payload);
  if (text === undefined) throw invalid("payload is not JSON");
  return text;
}

function typed(e: unknown): LanewayError | undefined {
  const err = e as { code?: unknown; message?: unknown };
  const message = typeof err?.message === "string" ? err.message : String(e);
  const m = /laneway: ([a-z_]+): /.exec(message);
  const sqlstate = typeof err?.code === "string" && /^[0-9A-Z]{5}$/.test(err.code) ? err.code : undefined;
  const code = m && CODES.has(m[1]) ? m[1] : sqlstate ? SQLSTATES[sqlstate] : undefined;
  if (!code) return undefined;
  return new LanewayError(code, m ? message.slice(m.index) : message, sqlstate, { cause: e });
}

function isSqlite(db: PgQueryable | SqliteDatabase): db is SqliteDatabase {
  return typeof (db as SqliteDatabase).prepare === "function" && "pragma" in db;
}

function schemaName(options?: Options): string {
  const schema = options?.schema ?? "laneway";
  if (!/^[a-z_][a-z0-9_]{0,62}$/.test(schema)) throw invalid(`schema must be a plain lower-case name, got ${schema}`);
  return schema;
}

function toId(v: unknown): number {
  const n = typeof v === "bigint" ? Number(v) : Number(v);
  if (!Number.isSafeInteger(n)) throw new LanewayError("conflict", `laneway: an op id ${String(v)} is not a safe integer`);
  return n;
}

/**
 * Enqueues one op in the caller's open transaction; resolves to the id of
 * the op that carries the intent (new, the one its idempotency key names,
 * or the one its coalesce key has pending).
 */
export async function enqueue(db: PgQueryable | SqliteDatabase, op: Op, options?: Options): Promise<number> {
  const [id] = await enqueueMany(db, [op], options);
  return id;
}

/** Several ops, all or nothing; their ids in order. */
export async function enqueueMany(db: PgQueryable | SqliteDatabase, ops: Op[], options?: Options): Promise<number[]> {
  if (!Array.isArray(ops)) throw invalid("ops must be an array");
  if (ops.length === 0) return [];
  ops.forEach(check);
  if (isSqlite(db)) {
    return ops.map((op) => sqliteEnqueue(db, op));
  }
  const body = ops.map((op) => {
    const item: Record<string, unknown> = { kind: op.kind, outbox: op.outbox, payload: JSON.parse(payloadText(op)) };
    if (op.lanes?.length) item.lanes = op.lanes;
    if (op.priority !== undefined) item.priority = op.priority;
    if (op.idempotencyKey != null) item.idempotency_key = op.idempotencyKey;
    if (op.coalesceKey != null) item.coalesce_key = op.coalesceKey;
    if (op.subject != null) item.subject = op.subject;
    if (op.correlationId != null) item.correlation_id = op.correlationId;
    if (op.delayMs !== undefined) item.delay_ms = op.delayMs;
    if (op.notBefore !== undefined) item.not_before = op.notBefore.toISOString();
    return item;
  });
  try {
    const result = await db.query(`SELECT id FROM ${schemaName(options)}.enqueue_many($1::jsonb) AS id`, [
      JSON.stringify(body),
    ]);
    return result.rows.map((r) => toId(r.id));
  } catch (e) {
    throw typed(e) ?? e;
  }
}

/** The producer contract version the database carries. */
export async function contractVersion(db: PgQueryable | SqliteDatabase, options?: Options): Promise<number> {
  if (isSqlite(db)) {
    const row = db.prepare("SELECT version FROM laneway_contract WHERE id = 1").get() as { version: number };
    return Number(row.version);
  }
  const result = await db.query(`SELECT ${schemaName(options)}.contract_version() AS version`);
  return Number(result.rows[0]?.version);
}

function sqliteEnqueue(db: SqliteDatabase, op: Op): number {
  let due = Date.now() + (op.delayMs ?? 0);
  if (op.notBefore !== undefined) due = Math.max(due, op.notBefore.getTime());
  const columns: Record<string, unknown> = {
    kind: op.kind,
    outbox: op.outbox,
    payload: payloadText(op),
    lanes: JSON.stringify(op.lanes ?? []),
    idempotency_key: op.idempotencyKey ?? null,
    coalesce_key: op.coalesceKey ?? null,
    subject: op.subject ?? null,
    correlation_id: op.correlationId ?? null,
    next_attempt_at: Math.trunc(due),
  };
  if (op.priority !== undefined) columns.priority = PRIORITIES[op.priority];
  const names = Object.keys(columns);
  let row: { id: number | bigint } | undefined;
  try {
    row = db
      .prepare(
        `INSERT INTO laneway_ops (${names.join(", ")}) VALUES (${names.map(() => "?").join(", ")}) ` +
          "ON CONFLICT DO NOTHING RETURNING id",
      )
      .get(...Object.values(columns)) as { id: number | bigint } | undefined;
  } catch (e) {
    throw typed(e) ?? e;
  }
  if (row) return toId(row.id);
  // Not inserted: the op its key names (live, or pruned: a tombstone), or
  // the one its coalesce key has pending.
  const lookups: Array<[string, unknown[]]> = [];
  if (op.idempotencyKey != null) {
    lookups.push(["SELECT id FROM laneway_ops WHERE outbox = ? AND idempotency_key = ?", [op.outbox, op.idempotencyKey]]);
    lookups.push([
      "SELECT op_id AS id FROM laneway_idempotency_tombstones WHERE outbox = ? AND idempotency_key = ?",
      [op.outbox, op.idempotencyKey],
    ]);
  }
  if (op.coalesceKey != null) {
    lookups.push([
      "SELECT id FROM laneway_ops WHERE outbox = ? AND coalesce_key = ? AND status IN ('pending', 'submitted')",
      [op.outbox, op.coalesceKey],
    ]);
  }
  for (const [sql, args] of lookups) {
    const found = db.prepare(sql).get(...args) as { id: number | bigint } | undefined;
    if (found) return toId(found.id);
  }
  throw new LanewayError("conflict", "laneway: conflict: the op conflicted with a concurrent change; run the transaction again");
}
