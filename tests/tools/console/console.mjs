// Drives laneway's operator console in a real headless Chromium, as an
// operator at 3 a.m. would: sign in, find the dead letter, preview and run
// a bulk recover, watch the op confirm live, pause and resume a kind, read
// the audit log; then as a read-only key, see no write control and have a
// forged write refused. tests/it/console.rs starts laneway and its fake
// inbox, then runs this with:
//   LW_BASE        the host's API (http://127.0.0.1:PORT)
//   LW_ADMIN_KEY   a key with outbox:read, outbox:write, plugins:admin
//   LW_READ_KEY    a key with outbox:read only
//   LW_DEAD_ID     the id of the dead letter to find and recover
//   LW_HOSTILE_ID  an op whose payload and correlation id hold HTML
//   LW_PRODUCER_KEY a key with ops:write, for dead letters made mid-run
//   LW_REFUSING_INBOX an inbox that refuses every delivery for good
//   LW_SHOTS       optional: a directory for a screenshot of each page
//   CHROMIUM       optional: the browser (default /usr/bin/chromium)
import { chromium } from 'playwright-core';

const base = must('LW_BASE');
const adminKey = must('LW_ADMIN_KEY');
const readKey = must('LW_READ_KEY');
const dead = must('LW_DEAD_ID');
const hostile = must('LW_HOSTILE_ID');
const producerKey = must('LW_PRODUCER_KEY');
const refusing = must('LW_REFUSING_INBOX');
const shots = process.env.LW_SHOTS || '';
const TIMEOUT = 20000;
// The whole run ends by itself, whatever hangs.
setTimeout(() => { console.error('the browser run passed its deadline'); process.exit(3); }, Number(process.env.LW_DEADLINE_MS || 240000)).unref();

function must(name) {
  const v = process.env[name];
  if (!v) { console.error(`${name} is not set`); process.exit(2); }
  return v;
}

function step(name) { console.log(`step: ${name}`); }

function check(cond, message) { if (!cond) throw new Error(message); }

async function call(method, path, key, body) {
  const r = await fetch(`${base}${path}`, { method, headers: { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' }, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await r.text();
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return JSON.parse(text);
}

// Deliveries to the refusing inbox, one per recipient URL (each its own
// lane), waited for until every one is a dead letter; their ids.
async function deadLetters(recipients, activity) {
  const answer = await call('POST', '/api/v1/activitypub/deliveries', producerKey, {
    outbox: 'https://console.laneway.example/actor',
    activity: { id: `https://console.laneway.example/a/${activity}`, type: 'Create' },
    recipients,
  });
  const ids = answer.deliveries.map(d => d.id);
  const until = Date.now() + TIMEOUT;
  for (;;) {
    const states = await Promise.all(ids.map(id => call('GET', `/api/admin/outbox/${id}`, adminKey).then(r => r.op.status)));
    if (states.every(s => s === 'failed')) return ids;
    check(Date.now() < until, `not dead-lettered in time: ${states}`);
    await new Promise(r => setTimeout(r, 200));
  }
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  // Root in CI has no user namespace sandbox to give Chromium.
  args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
const problems = [];
let failed = false;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  page.setDefaultTimeout(TIMEOUT);
  // Any script error or refused load (a CSP violation says "Refused to …")
  // fails the run.
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('console', (m) => { if (m.type() === 'error' && !/status of 40[13]/.test(m.text())) problems.push(`console: ${m.text()}`); });
  page.on('dialog', (d) => d.accept());
  const shot = async (name) => { if (shots) await page.screenshot({ path: `${shots}/${name}.png`, fullPage: true }); };
  const heading = (text) => page.getByRole('heading', { level: 1, name: text }).waitFor();

  step('a wrong key is refused with a message');
  await page.goto(`${base}/console`);
  await heading('Sign in');
  await shot('sign-in');
  await page.fill('#key', 'lw_nope_nope');
  await page.click('button[type=submit]');
  await page.getByText('unknown or revoked API key').waitFor();

  step('sign in');
  await page.fill('#key', adminKey);
  await page.click('button[type=submit]');
  await heading('Overview');
  await page.getByRole('heading', { name: 'Last hour' }).waitFor();
  await page.getByText('dead-lettered').first().waitFor();
  step('the overview charts the last hour and counts only held destinations');
  await page.locator('#activity-chart').waitFor();
  const totals = await page.evaluate(() => Object.fromEntries([...document.querySelectorAll('#activity-chart polyline')].map(l => [l.dataset.series, Number(l.dataset.total)])));
  check(totals.confirmed >= 3 && totals.failed >= 1 && 'retried' in totals, `chart totals: ${JSON.stringify(totals)}`);
  check(await page.locator('#activity-chart polyline').first().evaluate(l => l.getAttribute('points').split(' ').length) === 60, 'the chart does not have 60 minutes');
  // failing.example is failing, not held: /metrics' destinations_held is 0.
  const heldCard = await page.locator('.card', { hasText: 'destinations held' }).locator('.n').textContent();
  check(heldCard === '0', `destinations held shows ${heldCard} for a host only failing`);
  await page.getByText('No destination is held.').waitFor();
  await shot('overview');

  step('find the dead letter through the filters');
  await page.getByRole('link', { name: 'Ops', exact: true }).click();
  await heading('Ops');
  await page.selectOption('#f-status', 'failed');
  await page.fill('#f-kind', 'activitypub');
  await page.getByRole('button', { name: 'Filter' }).click();
  await page.getByRole('link', { name: `#${dead}`, exact: true }).click();
  await heading(`Op #${dead}`);
  await page.locator('dd', { hasText: /^failed$/ }).waitFor();
  await page.getByRole('button', { name: 'Retry' }).waitFor();
  await shot('op');

  step('preview, then run, a bulk recover');
  await page.getByRole('link', { name: 'Dead letters' }).click();
  await heading('Dead letters');
  await page.getByRole('cell', { name: 'permanent' }).waitFor();
  await page.getByText('1 dead letter, by kind').waitFor();
  // Empty means no limit, and the field says so.
  check(await page.getAttribute('#r-limit', 'placeholder') === 'no limit', 'the limit field shows a number where empty means no limit');
  await page.fill('#r-kind', 'activitypub');
  await page.click('#recover-preview');
  await page.getByText('1 dead letter would be recovered').waitFor();
  await shot('dead-letters');
  // Still a dead letter: the preview changed nothing.
  const before = await (await fetch(`${base}/api/admin/outbox/${dead}`, { headers: { Authorization: `Bearer ${adminKey}` } })).json();
  check(before.op.status === 'failed', `the preview changed the op: ${before.op.status}`);
  // Two more dead letters of the same filter arrive after the preview: the
  // confirmed recover must touch only what the operator was shown.
  const late = await deadLetters([`${refusing}?late=1`, `${refusing}?late=2`], 'late');
  await page.click('#recover-run');
  await page.getByText('Recovered 1;').waitFor();
  await page.locator('#recover-changed', { hasText: '2 dead letters matching the filter arrived after the preview' }).waitFor();
  for (const id of late) {
    const op = await call('GET', `/api/admin/outbox/${id}`, adminKey);
    check(op.op.status === 'failed', `op ${id}, not in the preview, was recovered: ${op.op.status}`);
  }

  step('the op reaches confirmed live, then its page stops polling');
  await page.goto(`${base}/console/#/op/${dead}`);
  await heading(`Op #${dead}`);
  await page.locator('dd', { hasText: /^confirmed$/ }).waitFor();
  await page.locator('#not-polling').waitFor();
  let polls = 0;
  const counter = (r) => { if (r.url().endsWith(`/api/admin/outbox/${dead}`)) polls += 1; };
  page.on('request', counter);
  await page.waitForTimeout(7000);
  page.off('request', counter);
  check(polls === 0, `a confirmed op's page polled ${polls} times in 7 s`);

  step('hostile text stays text');
  await page.goto(`${base}/console/#/op/${hostile}`);
  await heading(`Op #${hostile}`);
  await page.getByText('<b id=pwned>x</b>').waitFor();
  await page.getByText('onerror').waitFor();
  check(await page.evaluate(() => window.pwned === undefined && !document.getElementById('pwned') && !document.querySelector('main img')), 'payload HTML was parsed');

  step('pause and resume a kind');
  await page.getByRole('link', { name: 'Lanes, pauses, subjects' }).click();
  await heading('Lanes, pauses, subjects');
  await page.selectOption('#pause-scope', 'kind');
  await page.fill('#pause-target', 'activitypub');
  await page.fill('#pause-reason', 'console test');
  await page.click('#pause-submit');
  await page.locator('button[data-resume="kind/activitypub"]').waitFor();
  await shot('steering');
  await page.click('button[data-resume="kind/activitypub"]');
  await page.getByText('Nothing is paused.').waitFor();

  step('held lanes are paged');
  await deadLetters(Array.from({ length: 52 }, (_, i) => `${refusing}?lane=${i}`), 'lanes');
  await page.goto(`${base}/console/#/steering`);
  await heading('Lanes, pauses, subjects');
  await page.locator('#lanes-next').waitFor();
  const firstPage = await page.getByRole('button', { name: 'Skip' }).count();
  check(firstPage === 50, `the first page shows ${firstPage} held lanes`);
  await page.click('#lanes-next');
  await page.getByRole('link', { name: 'First held lanes' }).waitFor();
  const secondPage = await page.getByRole('button', { name: 'Skip' }).count();
  check(secondPage >= 2 && secondPage < 50, `the second page shows ${secondPage} held lanes`);

  step('destinations and audit');
  await page.getByRole('link', { name: 'Destinations' }).click();
  await heading('Destinations');
  await page.getByRole('heading', { name: 'Gone inboxes' }).waitFor();
  await shot('destinations');
  await page.getByRole('link', { name: 'Audit' }).click();
  await heading('Audit');
  await page.getByRole('cell', { name: 'op.recover' }).waitFor();
  await page.getByRole('cell', { name: 'pause', exact: true }).first().waitFor();
  await shot('audit');

  step('at a phone\'s width, with the keyboard');
  await page.setViewportSize({ width: 390, height: 844 });
  await page.goto(`${base}/console/#/`);
  await heading('Overview');
  const wide = await page.evaluate(() => document.documentElement.scrollWidth);
  check(wide <= 390 + 1, `the overview is ${wide}px wide at a 390px viewport`);
  await shot('overview-phone');
  // The first focusable element is the skip link; pages are reached and
  // forms used with the keyboard alone.
  check(await page.evaluate(() => document.querySelector('a[href], button, input, select').textContent) === 'Skip to content', 'the first focusable element is not "Skip to content"');
  await page.focus('nav a[href="#/ops"]');
  await page.keyboard.press('Enter');
  await heading('Ops');
  await page.focus('#f-kind');
  await page.keyboard.type('noop');
  await page.keyboard.press('Enter');
  await page.getByRole('cell', { name: 'noop' }).first().waitFor();
  await page.setViewportSize({ width: 1280, height: 900 });

  step('a read-only key sees no write control');
  await page.getByRole('button', { name: 'Sign out' }).click();
  await heading('Sign in');
  await page.fill('#key', readKey);
  await page.click('button[type=submit]');
  await heading('Overview');
  for (const [hash, title] of [[`#/op/${dead}`, `Op #${dead}`], ['#/dead', 'Dead letters'], ['#/steering', 'Lanes, pauses, subjects'], ['#/destinations', 'Destinations']]) {
    await page.goto(`${base}/console/${hash}`);
    await heading(title);
    await page.locator('#live').locator('table, p').first().waitFor();
    const writes = await page.locator('main button').count();
    check(writes === 0, `${hash}: a read-only key sees ${writes} write buttons`);
  }

  step('a forged write with the read-only key is refused');
  const forged = await page.evaluate(async (key) => {
    const r = await fetch('/api/admin/pauses', { method: 'POST', headers: { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' }, body: JSON.stringify({ scope: 'kind', target: 'activitypub' }) });
    return r.status;
  }, readKey);
  check(forged === 403, `a forged write answered ${forged}`);

  check(problems.length === 0, problems.join('\n'));
  step('done');
} catch (e) {
  failed = true;
  console.error(String(e && e.stack || e));
  if (problems.length) console.error(problems.join('\n'));
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
