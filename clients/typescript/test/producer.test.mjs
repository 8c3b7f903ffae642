// The TypeScript producer client against databases the real laneway binary
// migrated: SQLite through better-sqlite3 12, PostgreSQL through pg. Needs
// LW_LANEWAY_BIN (./dev test sets it) and TEST_PG_URL.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { randomUUID } from "node:crypto";
import Database from "better-sqlite3";
import pg from "pg";
import { enqueue, enqueueMany, contractVersion, LanewayError, CONTRACT_VERSION } from "../dist/index.js";

const PG_URL = process.env.TEST_PG_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const CONFIG = '[queue]\nmax_payload_bytes = 4096\n[kinds.email]\nlanes = "optional"\n';

function migrate(dir, url, extra = "") {
  const binary = process.env.LW_LANEWAY_BIN;
  assert.ok(binary, "LW_LANEWAY_BIN must name the laneway binary (./dev test sets it)");
  const config = join(dir, "laneway.toml");
  writeFileSync(config, `[database]\nurl = "${url}"\n${extra}\n${CONFIG}`);
  execFileSync(binary, ["--config", config, "migrate"], { stdio: "pipe" });
}

const refusals = [
  ["unknown_kind", { kind: "emial", outbox: "r", payload: {} }],
  ["lanes_required", { kind: "activitypub", outbox: "r", payload: {} }],
  ["lanes_required", { kind: "withdraw", outbox: "r", payload: {} }],
  ["payload_too_large", { kind: "email", outbox: "r", payload: "x".repeat(5000) }],
  ["invalid_op", { kind: "email", outbox: "", payload: {} }],
  ["invalid_op", { kind: "email", outbox: "r", payload: {}, lanes: [""] }],
  ["invalid_op", { kind: "email", outbox: "r", payload: {}, idempotencyKey: 7 }],
  ["invalid_op", { kind: "email", outbox: "r", payload: {}, priority: "urgent" }],
  ["internal_kind", { kind: "outcome_webhook", outbox: "r", payload: {} }],
];

test("SQLite: an op commits and rolls back with the caller's transaction, and refusals are typed", async () => {
  const dir = mkdtempSync(join(tmpdir(), "lw-ts-"));
  try {
    const file = join(dir, "app.db");
    migrate(dir, `sqlite://${file}`);
    const db = new Database(file);
    db.exec("CREATE TABLE orders (id INTEGER PRIMARY KEY)");
    for (const commit of [true, false]) {
      db.exec("BEGIN IMMEDIATE");
      db.exec("INSERT INTO orders DEFAULT VALUES");
      const id = await enqueue(db, { kind: "email", outbox: "shop", payload: { commit } });
      assert.ok(id > 0);
      db.exec(commit ? "COMMIT" : "ROLLBACK");
    }
    assert.equal(db.prepare("SELECT count(*) AS n FROM laneway_ops WHERE outbox = 'shop'").get().n, 1);
    assert.equal(db.prepare("SELECT count(*) AS n FROM orders").get().n, 1);

    const first = await enqueue(db, { kind: "email", outbox: "o", payload: { n: 1 }, idempotencyKey: "k" });
    assert.equal(await enqueue(db, { kind: "email", outbox: "o", payload: { n: 1 }, idempotencyKey: "k" }), first);
    await assert.rejects(
      enqueue(db, { kind: "email", outbox: "o", payload: { n: 2 }, idempotencyKey: "k" }),
      (e) => e instanceof LanewayError && e.code === "idempotency_conflict",
    );
    for (const [code, op] of refusals) {
      await assert.rejects(enqueue(db, op), (e) => e instanceof LanewayError && e.code === code, code);
    }
    assert.equal(db.prepare("SELECT count(*) AS n FROM laneway_ops WHERE outbox = 'r'").get().n, 0);

    const critical = await enqueue(db, { kind: "withdraw", outbox: "p", payload: {}, lanes: ["GSIGNER"] });
    const later = await enqueue(db, { kind: "email", outbox: "p", payload: null, delayMs: 3_600_000 });
    const ids = await enqueueMany(db, [
      { kind: "email", outbox: "p", payload: [1], priority: "low" },
      { kind: "email", outbox: "q", payload: "x" },
    ]);
    assert.equal(ids.length, 2);
    assert.equal(db.prepare("SELECT priority FROM laneway_ops WHERE id = ?").get(critical).priority, 0);
    assert.equal(db.prepare("SELECT priority FROM laneway_ops WHERE id = ?").get(ids[0]).priority, 2);
    const wait = db.prepare("SELECT next_attempt_at - created_at AS ms FROM laneway_ops WHERE id = ?").get(later).ms;
    assert.ok(wait >= 3_590_000 && wait <= 3_610_000, String(wait));
    assert.equal(await contractVersion(db), CONTRACT_VERSION);
    db.close();
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("PostgreSQL: an op commits and rolls back with the caller's transaction, and refusals are typed", async () => {
  const dir = mkdtempSync(join(tmpdir(), "lw-ts-"));
  const schema = `lwts_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
  const client = new pg.Client({ connectionString: PG_URL });
  await client.connect();
  try {
    migrate(dir, PG_URL, `schema = "${schema}"`);
    const options = { schema };
    await client.query(`CREATE TABLE ${schema}_orders (id serial PRIMARY KEY)`);
    for (const commit of [true, false]) {
      await client.query("BEGIN");
      await client.query(`INSERT INTO ${schema}_orders DEFAULT VALUES`);
      const id = await enqueue(client, { kind: "email", outbox: "shop", payload: { commit } }, options);
      assert.ok(id > 0);
      await client.query(commit ? "COMMIT" : "ROLLBACK");
    }
    const count = async (outbox) =>
      Number((await client.query(`SELECT count(*) AS n FROM ${schema}.ops WHERE outbox = $1`, [outbox])).rows[0].n);
    assert.equal(await count("shop"), 1);

    const first = await enqueue(client, { kind: "email", outbox: "o", payload: { n: 1 }, idempotencyKey: "k" }, options);
    assert.equal(await enqueue(client, { kind: "email", outbox: "o", payload: { n: 1 }, idempotencyKey: "k" }, options), first);
    await assert.rejects(
      enqueue(client, { kind: "email", outbox: "o", payload: { n: 2 }, idempotencyKey: "k" }, options),
      (e) => e instanceof LanewayError && e.code === "idempotency_conflict" && e.sqlstate === "LW005",
    );
    for (const [code, op] of refusals) {
      await assert.rejects(enqueue(client, op, options), (e) => e instanceof LanewayError && e.code === code, code);
    }
    assert.equal(await count("r"), 0);
    // Inside a transaction, a refusal fails the transaction, as any error does.
    await client.query("BEGIN");
    await assert.rejects(enqueue(client, refusals[0][1], options), LanewayError);
    await client.query("ROLLBACK");
    const ids = await enqueueMany(
      client,
      [
        { kind: "email", outbox: "b", payload: [1], priority: "low" },
        { kind: "email", outbox: "a", payload: null, delayMs: 1000 },
      ],
      options,
    );
    assert.equal(ids.length, 2);
    assert.equal(await contractVersion(client, options), CONTRACT_VERSION);
  } finally {
    await client.query(`DROP TABLE IF EXISTS ${schema}_orders`);
    await client.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await client.end();
    rmSync(dir, { recursive: true, force: true });
  }
});
