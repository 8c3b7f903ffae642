// graphile-worker's side of `cargo run --release --example bench`: enqueue N
// no-op jobs (batches of 1000, with addJobs), then time one worker pool
// draining them, and print one JSON line. graphile-worker itself is installed
// by the bench into a scratch folder (never committed); this file is ours.
//
//   node graphile_bench.mjs POSTGRES_URL SCHEMA N [CONCURRENCY]
import { makeWorkerUtils, run } from "graphile-worker";

const [url, schema, nText, concurrencyText] = process.argv.slice(2);
const n = Number(nText);
const concurrency = Number(concurrencyText ?? "16");
if (!url || !schema || !(n > 0)) {
  console.error("usage: node graphile_bench.mjs POSTGRES_URL SCHEMA N [CONCURRENCY]");
  process.exit(2);
}

const preset = {
  worker: {
    connectionString: url,
    schema,
    concurrentJobs: concurrency,
    maxPoolSize: concurrency + 2,
    pollInterval: 1000,
    // Batched fetching and completion: graphile-worker's fastest settings.
    localQueue: { size: 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  },
};

const utils = await makeWorkerUtils({ connectionString: url, schema });
await utils.migrate();
const enqueueStart = process.hrtime.bigint();
for (let done = 0; done < n; done += 1000) {
  const batch = [];
  for (let i = done; i < Math.min(n, done + 1000); i++) {
    batch.push({ identifier: "noop", payload: { i } });
  }
  await utils.addJobs(batch);
}
const enqueueSeconds = Number(process.hrtime.bigint() - enqueueStart) / 1e9;

let finished = 0;
let resolveAll;
const all = new Promise((resolve) => {
  resolveAll = resolve;
});
const start = process.hrtime.bigint();
const runner = await run({
  preset,
  noHandleSignals: true,
  logger: undefined,
  taskList: {
    noop: async () => {
      finished += 1;
      if (finished === n) resolveAll();
    },
  },
});
await all;
// Completions are batched: the drain ends when the last one is committed,
// which stopping the runner waits for.
await runner.stop();
const seconds = Number(process.hrtime.bigint() - start) / 1e9;
await utils.release();
console.log(JSON.stringify({ ops: n, enqueue_per_s: n / enqueueSeconds, drain_per_s: n / seconds }));
