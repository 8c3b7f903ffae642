// A shop that sends an order confirmation through laneway, in TypeScript.
//
// The order row and the email's op commit in one transaction; an order
// whose transaction fails leaves no op. The outcome comes back through
// laneway's outcome feed, filtered to the shop's outbox.
//
//   npm ci --prefix clients/typescript && npm run build --prefix clients/typescript
//   clients/typescript/node_modules/.bin/tsc -p examples/producers
//   LW_API_KEY=lw_... node examples/producers/shop.mjs postgres://user@host/db
//   LW_API_KEY=lw_... node examples/producers/shop.mjs sqlite://shop.db
//
// (laneway running with examples/producers/laneway.toml; see that file.)
import { randomUUID } from "node:crypto";
import { createRequire } from "node:module";
import { enqueue, type PgQueryable, type SqliteDatabase } from "../../clients/typescript/dist/index.js";

const load = createRequire(import.meta.url);
const API = process.env.LW_API ?? "http://127.0.0.1:7480";

interface Shop {
  db: PgQueryable | SqliteDatabase;
  run(sql: string, params?: unknown[]): Promise<void>;
  close(): Promise<void>;
  begin: string;
}

async function connect(url: string): Promise<Shop> {
  const ddl = "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL)";
  if (url.startsWith("sqlite://")) {
    const Database = load("../../clients/typescript/node_modules/better-sqlite3");
    const db = new Database(url.slice("sqlite://".length));
    db.exec(ddl);
    return {
      db,
      begin: "BEGIN IMMEDIATE",
      run: async (sql, params = []) => void db.prepare(sql).run(...params),
      close: async () => db.close(),
    };
  }
  const pg = load("../../clients/typescript/node_modules/pg");
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  await client.query(ddl);
  return {
    db: client,
    begin: "BEGIN",
    run: async (sql, params = []) => {
      let n = 0;
      await client.query(sql.replace(/\?/g, () => `$${++n}`), params);
    },
    close: async () => client.end(),
  };
}

/** The business write and its side effect's op, in one transaction. */
async function placeOrder(shop: Shop, order: string, customer: string, fail = false): Promise<number> {
  await shop.run(shop.begin);
  try {
    await shop.run("INSERT INTO orders (id, customer) VALUES (?, ?)", [order, customer]);
    const opId = await enqueue(shop.db, {
      kind: "email",
      outbox: "shop",
      payload: { to: customer, template: "order-confirmed", order },
      lanes: [`customer:${customer}`],
      idempotencyKey: `order-confirmed:${order}`,
      correlationId: order,
    });
    if (fail) throw new Error("the payment was declined");
    await shop.run("COMMIT");
    return opId;
  } catch (e) {
    await shop.run("ROLLBACK");
    throw e;
  }
}

interface Outcome {
  status: string;
  op: { id: number; attempts: number };
}

/** Follows the outcome feed (this outbox only) until the op is terminal. */
async function outcome(opId: number, timeoutMs = 30_000): Promise<Outcome> {
  const key = process.env.LW_API_KEY;
  if (!key) throw new Error("set LW_API_KEY to a key with the outcomes:read scope");
  let after: string | null = null;
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const query = "outbox=shop" + (after ? `&after=${encodeURIComponent(after)}` : "");
    const answer = await fetch(`${API}/api/v1/outcomes?${query}`, { headers: { authorization: `Bearer ${key}` } });
    const page = (await answer.json()) as { outcomes: Outcome[]; next: string | null };
    const mine = page.outcomes.find((e) => e.op.id === opId);
    if (mine) return mine;
    after = page.next ?? after;
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`op ${opId} reached no outcome in ${timeoutMs} ms`);
}

const shop = await connect(process.argv[2] ?? "sqlite://shop.db");
const order = `o-${randomUUID().slice(0, 8)}`;
const opId = await placeOrder(shop, order, "c-3");
console.log(`order ${order} committed with op ${opId}`);
try {
  await placeOrder(shop, `${order}-declined`, "c-4", true);
} catch (e) {
  console.log(`order ${order}-declined rolled back (${(e as Error).message}); no op was enqueued for it`);
}
const entry = await outcome(opId);
console.log(`op ${opId}: ${entry.status} after ${entry.op.attempts} attempt(s)`);
await shop.close();
process.exitCode = entry.status === "confirmed" ? 0 : 1;
