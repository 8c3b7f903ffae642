// A TypeScript client generated from a running laneway's /api/openapi.json
// with openapi-typescript, as a producer team would make one: a real call
// written against the generated types must compile under `tsc --strict`
// (any JSON payload, the batch body, typed answers, the outcome webhook's
// body) and then enqueue through the running binary.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import openapiTS, { astToString } from "openapi-typescript";

const here = fileURLToPath(new URL("..", import.meta.url));

function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
    server.on("error", reject);
  });
}

async function untilUp(base, host) {
  for (let i = 0; i < 200; i++) {
    if (host.exitCode !== null) throw new Error(`laneway run exited with ${host.exitCode}`);
    try {
      if ((await fetch(`${base}/healthz`)).ok) return;
    } catch {}
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error("laneway run did not come up");
}

const CALL = `
import type { paths, components } from "./api.js";

type EnqueueBody = paths["/api/v1/ops"]["post"]["requestBody"]["content"]["application/json"];
type Created = paths["/api/v1/ops"]["post"]["responses"]["201"]["content"]["application/json"];
type Page = paths["/api/v1/outcomes"]["get"]["responses"]["200"]["content"]["application/json"];
type Webhook = components["schemas"]["OutcomeWebhook"];

// Any JSON is a payload: an object, an array, a string, a number, null.
const one: EnqueueBody = { kind: "email", outbox: "shop", lanes: ["customer:c-3"], payload: { order: "o-17", items: [1, 2] }, priority: "critical" };
const batch: EnqueueBody = { ops: [{ kind: "email", outbox: "shop", payload: [1, "two", null] }, { kind: "email", outbox: "shop", payload: null }] };

export function onWebhook(body: Webhook): string {
  return body.type + " " + body.data.op.id + " " + (body.data.final_attempt?.class ?? "none");
}

export function firstCursor(page: Page): string | null | undefined {
  return page.outcomes[0]?.cursor ?? page.next;
}

const [base, key] = process.argv.slice(2);
const answer = await fetch(base + "/api/v1/ops", {
  method: "POST",
  headers: { authorization: "Bearer " + key, "content-type": "application/json" },
  body: JSON.stringify(one),
});
const created = (await answer.json()) as Created;
const id: number = created.id;
const status: "created" | "existing" | "already_pending" = created.status;
const many = await fetch(base + "/api/v1/ops", {
  method: "POST",
  headers: { authorization: "Bearer " + key, "content-type": "application/json" },
  body: JSON.stringify(batch),
});
console.log(JSON.stringify({ http: answer.status, id, status, batch: many.status }));
`;

test("a client generated from /api/openapi.json compiles a real call under tsc --strict and enqueues", async () => {
  const binary = process.env.LW_LANEWAY_BIN;
  assert.ok(binary, "LW_LANEWAY_BIN must name the laneway binary (./dev test sets it)");
  const dir = mkdtempSync(join(tmpdir(), "lw-openapi-"));
  const port = await freePort();
  const config = join(dir, "laneway.toml");
  writeFileSync(
    config,
    `[database]\nurl = "sqlite://${join(dir, "q.db")}"\n[api]\nlisten = "127.0.0.1:${port}"\n[kinds.email]\nlanes = "optional"\n`,
  );
  execFileSync(binary, ["--config", config, "migrate"], { stdio: "pipe" });
  const key = JSON.parse(
    execFileSync(binary, ["--config", config, "api-keys", "new", "--name", "gen", "--scopes", "ops:write", "--json"]),
  ).secret;
  const host = spawn(binary, ["--config", config, "run"], { stdio: "ignore" });
  const generated = join(here, ".generated");
  try {
    const base = `http://127.0.0.1:${port}`;
    await untilUp(base, host);
    const document = await (await fetch(`${base}/api/openapi.json`)).json();
    assert.ok(document.webhooks?.["op.outcome"], "the outcome webhook is in the document");
    mkdirSync(generated, { recursive: true });
    writeFileSync(join(generated, "package.json"), '{"type": "module"}\n');
    writeFileSync(join(generated, "api.d.ts"), astToString(await openapiTS(document)));
    writeFileSync(join(generated, "call.mts"), CALL);
    execFileSync(
      join(here, "node_modules/.bin/tsc"),
      ["--strict", "--target", "es2022", "--module", "nodenext", "--moduleResolution", "nodenext", "--types", "node",
        "--typeRoots", join(here, "node_modules/@types"), "--outDir", generated, join(generated, "call.mts")],
      { stdio: "pipe" },
    );
    const out = JSON.parse(execFileSync(process.execPath, [join(generated, "call.mjs"), base, key]).toString());
    assert.deepEqual([out.http, out.status, out.batch], [201, "created", 200]);
    assert.ok(out.id > 0);
  } catch (e) {
    if (e.stdout) console.error(e.stdout.toString());
    throw e;
  } finally {
    host.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
    rmSync(generated, { recursive: true, force: true });
  }
});
