// The laneway operator console. It calls the host's API with the key the
// operator signed in with (kept in this tab's sessionStorage only) and
// builds every element with the DOM API: nothing the API returns is ever
// parsed as HTML, so a hostile payload, error or inbox name stays text.
'use strict';

const KEY = 'laneway.console.key';
const POLL_MS = 3000;
// The overview's counts cost the database most (depth reads an index of
// every op kept), so it refreshes less often.
const OVERVIEW_POLL_MS = 10000;
const PAGE = 50;

const state = { key: sessionStorage.getItem(KEY), actor: null, scopes: [], timer: null, route: null, refreshFailed: false, refreshing: null, nav: 0 };

// ---- small helpers -------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  el.append(...nodes(children));
  return el;
}

// Children as the DOM takes them: nested lists flattened, what is absent
// skipped, anything else as text (never parsed as HTML).
function nodes(children) {
  return children.flat(Infinity).filter(c => c !== null && c !== undefined && c !== false).map(c => (c instanceof Node ? c : String(c)));
}

// Replaces an element's children.
function fill(el, ...children) {
  el.replaceChildren(...nodes(children));
}

function may(scope) { return state.scopes.includes(scope); }

function say(text, error) {
  const el = document.getElementById('status');
  el.textContent = text || '';
  el.className = error ? 'error' : '';
}

class ApiFailure extends Error {
  constructor(status, code, message) { super(`${message} (${code}, HTTP ${status})`); this.status = status; this.code = code; }
}

async function api(method, path, body) {
  const headers = { Accept: 'application/json', Authorization: `Bearer ${state.key}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), credentials: 'omit', cache: 'no-store' });
  let json = null;
  try { json = await response.json(); } catch (_) { json = null; }
  if (!response.ok) {
    const e = (json && json.error) || {};
    if (response.status === 401) signOut('The key was refused: sign in again.');
    throw new ApiFailure(response.status, e.code || 'error', e.message || response.statusText);
  }
  return json;
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== '' && v !== null && v !== undefined) q.set(k, v);
  const s = q.toString();
  return s ? `?${s}` : '';
}

function when(ts) {
  if (!ts) return '';
  const d = new Date(ts);
  return Number.isNaN(d.getTime()) ? String(ts) : d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z');
}

function table(caption, columns, rows, empty) {
  if (!rows.length) return h('p', { class: 'muted' }, empty || 'None.');
  return h('div', { class: 'table' }, h('table', {},
    h('caption', {}, caption),
    h('thead', {}, h('tr', {}, columns.map(c => h('th', { scope: 'col', class: c.num ? 'num' : null }, c.title)))),
    h('tbody', {}, rows.map(r => h('tr', {}, columns.map(c => h('td', { class: c.num ? 'num' : null }, c.cell(r))))))));
}

function button(label, onclick, attrs) {
  return h('button', Object.assign({ type: 'button', onclick }, attrs || {}), label);
}

// A write: asks first, reports the result, refreshes the page.
async function act(question, run, done) {
  if (question && !window.confirm(question)) return;
  try {
    const result = await run();
    say(done(result));
    await refresh();
  } catch (e) {
    say(e.message, true);
  }
}

// Payload values under names that look secret are shown as [redacted].
const SECRET = /(secret|password|passphrase|token|private|seed|authorization|api[_-]?key|signature)/i;
function redact(value) {
  if (Array.isArray(value)) return value.map(redact);
  if (value && typeof value === 'object') {
    const out = {};
    for (const [k, v] of Object.entries(value)) out[k] = SECRET.test(k) ? '[redacted]' : redact(v);
    return out;
  }
  return value;
}

function pretty(text) {
  try { return JSON.stringify(redact(JSON.parse(text)), null, 2); } catch (_) { return text; }
}

function opLink(id) { return h('a', { href: `#/op/${id}` }, `#${id}`); }

function statusText(s) {
  const cls = { failed: 'bad', submitted: 'warn', confirmed: 'ok' }[s];
  return h('span', { class: cls || null }, s);
}

// ---- sign-in ---------------------------------------------------------------

function signOut(message) {
  sessionStorage.removeItem(KEY);
  state.key = null; state.actor = null; state.scopes = [];
  document.getElementById('nav').hidden = true;
  document.getElementById('who').hidden = true;
  route();
  if (message) say(message, true);
}

function signInPage(main) {
  const input = h('input', { id: 'key', name: 'key', type: 'password', autocomplete: 'off', required: true, placeholder: 'lw_…' });
  main.append(
    h('h1', {}, 'Sign in'),
    h('p', {}, 'Paste an API key (', h('code', {}, 'laneway api-keys new'), '). It stays in this tab only and is sent to this host alone; what its scopes do not allow is not shown, and the API refuses it anyway.'),
    h('form', { class: 'stack', onsubmit: async (ev) => {
      ev.preventDefault();
      state.key = input.value.trim();
      try {
        await whoami();
        sessionStorage.setItem(KEY, state.key);
        say('');
        location.hash = '#/';
        route();
      } catch (e) {
        state.key = null;
        say(e.message, true);
      }
    } }, h('label', { for: 'key' }, 'API key'), input, h('button', { type: 'submit' }, 'Sign in')));
  input.focus();
}

async function whoami() {
  const me = await api('GET', '/api/admin/whoami');
  state.actor = me.actor; state.scopes = me.scopes || [];
  const who = document.getElementById('who');
  who.replaceChildren(`${me.actor} · ${state.scopes.join(', ')} `, button('Sign out', () => signOut()));
  who.hidden = false;
  document.getElementById('nav').hidden = false;
}

// ---- pages -------------------------------------------------------------------

async function overview(main, live) {
  main.append(h('h1', {}, 'Overview'), live);
  return async () => {
    const [stats, activity, breakers, pauses, dests, conditions, plugins] = await Promise.all([
      api('GET', '/api/admin/outbox/stats'),
      api('GET', '/api/admin/outbox/activity'),
      api('GET', '/api/admin/breakers'),
      api('GET', '/api/admin/pauses'),
      api('GET', '/api/admin/destinations'),
      api('GET', '/api/v1/network/conditions').catch(() => null),
      may('plugins:admin') ? api('GET', '/api/admin/plugins') : Promise.resolve(null),
    ]);
    const by = {};
    for (const d of stats.depth) {
      by[d.status] = by[d.status] || { critical: 0, normal: 0, low: 0, total: 0 };
      by[d.status][d.priority] += d.count; by[d.status].total += d.count;
    }
    const count = (s) => (activity.counts.find(c => c.status === s) || { count: 0 }).count;
    const hours = Math.max(activity.covered_seconds, 1) / 3600;
    // Held as /metrics counts destinations_held: unavailable or suspended
    // (an available host with failures counted is not held).
    const held = dests.destinations.filter(d => d.state === 'unavailable' || d.state === 'suspended');
    const open = breakers.breakers.filter(b => b.state !== 'closed');
    const card = (label, n, cls) => h('div', { class: 'card' }, h('span', { class: `n ${cls || ''}` }, n), label);
    fill(live, 
      h('h2', {}, 'Last hour'),
      h('div', { class: 'cards' },
        card('confirmed', count('confirmed')),
        card('dead-lettered', count('failed'), count('failed') ? 'bad' : ''),
        card('cancelled', count('cancelled')),
        card('settled per minute', perMinute((count('confirmed') + count('failed')) / (hours * 60))),
        card('failure rate', activity.failure_rate === null ? '–' : `${(activity.failure_rate * 100).toFixed(1)} %`, activity.failure_rate > 0.05 ? 'bad' : ''),
        card('stuck submitted', stats.stuck_submitted, stats.stuck_submitted ? 'warn' : ''),
        card('lanes held', stats.lanes_held, stats.lanes_held ? 'warn' : ''),
        card('subjects halted', stats.subjects_halted),
        card('breakers open', open.length, open.length ? 'warn' : ''),
        card('destinations held', held.length, held.length ? 'warn' : ''),
        card('pauses', pauses.pauses.length, pauses.pauses.length ? 'warn' : '')),
      activity.covered_seconds < activity.window_seconds ? h('p', { class: 'muted' }, `Counted over the newest outcomes: the last ${activity.covered_seconds} s.`) : null,
      chart(activity.per_minute || []),
      h('h2', {}, 'Depth'),
      table('Ops by status and priority', [
        { title: 'status', cell: r => h('a', { href: `#/ops${query({ status: r[0] })}` }, r[0]) },
        { title: 'critical', num: true, cell: r => r[1].critical },
        { title: 'normal', num: true, cell: r => r[1].normal },
        { title: 'low', num: true, cell: r => r[1].low },
        { title: 'total', num: true, cell: r => r[1].total },
      ], Object.entries(by), 'The queue is empty.'),
      h('h2', {}, 'Oldest due'),
      table('Per kind and outbox, how long the oldest due op has waited', [
        { title: 'kind', cell: r => r.kind }, { title: 'outbox', cell: r => r.outbox },
        { title: 'due at', cell: r => when(r.due_at) },
        { title: 'waited (s)', num: true, cell: r => Math.round(r.age_seconds) },
      ], stats.oldest_due, 'Nothing is due.'),
      h('h2', {}, 'Breakers (this host)'),
      table('Destinations with a breaker not closed', [
        { title: 'destination', cell: r => r.destination }, { title: 'state', cell: r => r.state },
        { title: 'failures', num: true, cell: r => r.failures }, { title: 'last error', cell: r => r.last_error || '' },
      ], open, 'Every breaker is closed.'),
      h('h2', {}, 'Held destinations'),
      table('Unavailable or suspended destination hosts', [
        { title: 'host', cell: r => r.host }, { title: 'state', cell: r => r.state },
        { title: 'reason', cell: r => r.reason || r.last_error || '' }, { title: 'next probe', cell: r => when(r.next_probe_at) },
      ], held, 'No destination is held.'),
      h('h2', {}, 'Pauses'),
      table('Paused kinds, outboxes and destinations', [
        { title: 'scope', cell: r => r.scope }, { title: 'target', cell: r => r.target },
        { title: 'by', cell: r => r.actor }, { title: 'since', cell: r => when(r.paused_at) },
      ], pauses.pauses, 'Nothing is paused.'),
      conditions ? [h('h2', {}, 'Fee oracles'),
        table('Each oracle\'s latest sample', [
          { title: 'oracle', cell: r => r[0] },
          { title: 'congestion', cell: r => (r[1].snapshot || {}).congestion ?? 'no sample' },
          { title: 'capacity used', num: true, cell: r => (r[1].snapshot || {}).ledger_capacity_usage ?? '' },
          { title: 'recommended fee', num: true, cell: r => (r[1].snapshot || {}).recommended_base_fee ?? '' },
          { title: 'aggressive fee', num: true, cell: r => (r[1].snapshot || {}).aggressive_base_fee ?? '' },
          { title: 'sampled', cell: r => when(r[1].sampled_at) },
          { title: 'age (s)', num: true, cell: r => r[1].sampled_at ? Math.round((Date.now() - new Date(r[1].sampled_at)) / 1000) : '' },
        ], Object.entries(conditions.oracles || {}), 'No fee oracle is configured.')] : null,
      plugins ? [h('h2', {}, 'Plugins'),
        table('Loaded plugins', [
          { title: 'name', cell: r => r.name }, { title: 'contract', cell: r => r.contract },
          { title: 'digest', cell: r => h('code', {}, (r.digest || '').slice(0, 16)) },
          { title: 'quarantined', cell: r => r.quarantined ? h('span', { class: 'bad' }, 'yes') : 'no' },
        ], plugins.plugins || [], 'No plugin is loaded.'),
        h('p', {}, `Reloads: ${plugins.reloads.loads} loaded, ${plugins.reloads.failures} refused. `,
          plugins.reloads.last_error ? h('span', { class: 'bad' }, `Last refused: ${plugins.reloads.last_error}`) : 'The last reload was applied.',
          plugins.reloads.refused_kinds.length ? h('span', { class: 'bad' }, ` Kinds not activated: ${plugins.reloads.refused_kinds.join(', ')}.`) : '')] : null,
    );
  };
}

// The last hour per minute as an SVG the page draws itself: confirmed,
// retried and dead-lettered, one line each, with the totals written out
// (the chart is never the only place a number is).
const SERIES = [['confirmed', 'confirmed', 'ok'], ['retried', 'retried', 'warn'], ['failed', 'dead-lettered', 'bad']];
function chart(minutes) {
  const NS = 'http://www.w3.org/2000/svg';
  const svg = (tag, attrs, ...kids) => {
    const el = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    el.append(...nodes(kids));
    return el;
  };
  const [width, height, pad] = [600, 140, 24];
  const top = Math.max(1, ...minutes.flatMap(m => SERIES.map(([k]) => m[k] || 0)));
  const x = (i) => pad + (i * (width - 2 * pad)) / Math.max(1, minutes.length - 1);
  const y = (n) => height - pad - (n * (height - 2 * pad)) / top;
  const totals = Object.fromEntries(SERIES.map(([k]) => [k, minutes.reduce((n, m) => n + (m[k] || 0), 0)]));
  const label = SERIES.map(([k, name]) => `${totals[k]} ${name}`).join(', ');
  const lines = SERIES.map(([k, name, cls]) => svg('polyline', {
    class: `line ${cls}`, 'data-series': k, 'data-total': totals[k],
    points: minutes.map((m, i) => `${x(i).toFixed(1)},${y(m[k] || 0).toFixed(1)}`).join(' '),
  }, svg('title', {}, `${name}: ${totals[k]} in the last hour`)));
  return h('figure', { class: 'chart' },
    svg('svg', { id: 'activity-chart', viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': `Per minute over the last hour: ${label}` },
      svg('line', { class: 'axis', x1: pad, y1: height - pad, x2: width - pad, y2: height - pad }),
      svg('text', { class: 'tick', x: pad, y: height - 6 }, '60 min ago'),
      svg('text', { class: 'tick', x: width - pad, y: height - 6, 'text-anchor': 'end' }, 'now'),
      svg('text', { class: 'tick', x: pad, y: pad - 8 }, `${top} a minute`),
      ...lines),
    h('figcaption', {}, SERIES.map(([k, name, cls]) => [h('span', { class: `key ${cls}` }, `■ ${name} ${totals[k]}`), ' '])));
}

function perMinute(rate) { return rate >= 10 ? Math.round(rate) : rate.toFixed(1); }

const FILTERS = ['kind', 'outbox', 'status', 'priority', 'lane', 'subject', 'correlation_id', 'created_after', 'created_before'];

async function ops(main, live, params) {
  const field = (name) => {
    const id = `f-${name}`;
    let input;
    if (name === 'status') input = h('select', { id, name }, ['', 'pending', 'submitted', 'confirmed', 'failed', 'cancelled'].map(v => h('option', { value: v, selected: params.get(name) === v }, v || 'any')));
    else if (name === 'priority') input = h('select', { id, name }, ['', 'critical', 'normal', 'low'].map(v => h('option', { value: v, selected: params.get(name) === v }, v || 'any')));
    else input = h('input', { id, name, value: params.get(name) || '', placeholder: name.startsWith('created') ? '2026-12-01T00:00:00Z' : '' });
    return h('label', { for: id }, name.replace('_', ' '), input);
  };
  const form = h('form', { class: 'filters', onsubmit: (ev) => {
    ev.preventDefault();
    const data = new FormData(form);
    const q = {};
    for (const name of FILTERS) q[name] = (data.get(name) || '').trim();
    location.hash = `#/ops${query(q)}`;
  } }, FILTERS.map(field), h('button', { type: 'submit' }, 'Filter'));
  main.append(h('h1', {}, 'Ops'), form, live);
  return async () => {
    const q = { limit: PAGE, order: params.get('order') || 'desc', after: params.get('after') };
    for (const name of FILTERS) q[name] = params.get(name);
    const page = await api('GET', `/api/admin/outbox${query(q)}`);
    const next = new URLSearchParams(params); if (page.next !== null) next.set('after', page.next);
    const first = new URLSearchParams(params); first.delete('after');
    fill(live, 
      table(`Ops, ${q.order === 'asc' ? 'oldest' : 'newest'} first`, [
        { title: 'op', cell: r => opLink(r.id) }, { title: 'kind', cell: r => r.kind }, { title: 'outbox', cell: r => r.outbox },
        { title: 'status', cell: r => statusText(r.status) }, { title: 'priority', cell: r => r.priority },
        { title: 'attempts', num: true, cell: r => r.attempts }, { title: 'lanes', cell: r => r.lanes.join(' ') },
        { title: 'updated', cell: r => when(r.updated_at) }, { title: 'last error', cell: r => r.last_error || '' },
      ], page.ops, 'No op matches.'),
      h('p', { class: 'actions' },
        params.get('after') ? h('a', { href: `#/ops?${first}` }, 'First page') : null,
        page.next !== null ? h('a', { href: `#/ops?${next}`, rel: 'next' }, 'Next page') : null));
  };
}

async function op(main, live, params, id) {
  main.append(h('h1', {}, `Op #${id}`), live);
  return async () => {
    const { op: o, attempts } = await api('GET', `/api/admin/outbox/${encodeURIComponent(id)}`);
    const writes = may('outbox:write');
    // A final op does not change by itself: polling stops (a retry or
    // cancel from this page refreshes it, and polling starts again).
    const final = ['confirmed', 'failed', 'cancelled'].includes(o.status);
    polling(!final);
    fill(live, 
      final ? h('p', { class: 'muted', id: 'not-polling' }, `This op is ${o.status}: the page no longer refreshes by itself.`) : null,
      h('dl', { class: 'fields' },
        ['status', 'kind', 'outbox', 'priority', 'attempts', 'subject', 'correlation_id', 'idempotency_key', 'next_attempt_at', 'lease_owner', 'lease_until', 'receipt', 'last_error', 'created_at', 'updated_at', 'finished_at']
          .map(k => [h('dt', {}, k.replace(/_/g, ' ')), h('dd', {}, k === 'status' ? statusText(o[k]) : (k.endsWith('_at') || k === 'lease_until' ? when(o[k]) : (o[k] ?? '')))])),
      o.status === 'failed' && o.receipt ? h('p', { class: 'warn' }, 'Outcome unknown: a receipt was issued and never proven landed or dead. Retrying may apply the side effect twice.') : null,
      writes ? h('div', { class: 'actions' },
        o.status === 'failed' ? button('Retry', () => act(`Put op #${id} back to pending with a fresh attempt budget?`, () => api('POST', `/api/admin/outbox/${id}/retry`), () => `Op #${id} is pending again.`)) : null,
        o.status === 'pending' ? button('Cancel', () => act(`Cancel op #${id}? It will never be attempted.`, () => api('POST', `/api/admin/outbox/${id}/cancel`), () => `Op #${id} is cancelled.`), { class: 'danger' }) : null) : null,
      h('h2', {}, 'Lanes'), h('ul', {}, o.lanes.map(l => h('li', {}, h('a', { href: `#/ops${query({ lane: l })}` }, l)))),
      h('h2', {}, 'Attempts'),
      table('Every attempt, oldest first', [
        { title: '#', num: true, cell: r => r.attempt }, { title: 'class', cell: r => r.class },
        { title: 'started', cell: r => when(r.started_at) },
        { title: 'took (ms)', num: true, cell: r => Math.max(0, new Date(r.finished_at) - new Date(r.started_at)) },
        { title: 'fee', num: true, cell: r => r.fee ?? '' }, { title: 'error', cell: r => r.error || '' }, { title: 'detail', cell: r => r.detail || '' },
      ], attempts, 'Not attempted yet.'),
      h('h2', {}, 'Payload'), h('p', { class: 'muted' }, 'Values under names that look secret are redacted.'),
      h('pre', {}, pretty(o.payload)));
  };
}

async function dead(main, live) {
  const preview = h('div', { id: 'preview' });
  const input = (name, label, placeholder) => h('label', { for: `r-${name}` }, label, h('input', { id: `r-${name}`, name, placeholder: placeholder || '' }));
  const form = h('form', { class: 'filters' },
    input('kind', 'kind'), input('outbox', 'outbox'),
    input('failed_after', 'failed after', '2026-12-01T00:00:00Z'), input('failed_before', 'failed before', ''),
    input('limit', 'at most (oldest first)', 'no limit'), input('include_unknown', 'outcome-unknown ids to include', '12, 40'));
  const body = (dryRun) => {
    const d = new FormData(form);
    const b = { dry_run: dryRun };
    for (const k of ['kind', 'outbox', 'failed_after', 'failed_before']) { const v = (d.get(k) || '').trim(); if (v) b[k] = v; }
    const limit = (d.get('limit') || '').trim(); if (limit) b.limit = Number(limit);
    const ids = (d.get('include_unknown') || '').split(/[\s,]+/).filter(Boolean).map(Number);
    if (ids.length) b.include_unknown = ids;
    return b;
  };
  const previewRun = async () => {
    try {
      const r = await api('POST', '/api/admin/outbox/recover', body(true));
      const n = r.would_recover.length;
      fill(preview, 
        h('p', {}, h('strong', {}, `${n} dead letter${n === 1 ? '' : 's'} would be recovered`),
          r.unknown_left_out.length ? `; ${r.unknown_left_out.length} with an unknown outcome are left out unless named.` : '.'),
        n ? h('p', {}, 'Sample: ', r.would_recover.slice(0, 20).map(id => [opLink(id), ' '])) : null,
        r.unknown_left_out.length ? h('p', {}, 'Left out (outcome unknown): ', r.unknown_left_out.slice(0, 20).map(id => [opLink(id), ' '])) : null,
        n ? h('p', { class: 'muted' }, 'Exactly these are recovered, each if it is still a dead letter: dead letters arriving after this preview are left alone.') : null,
        // The confirmed recover names the previewed ids: the API recovers
        // those and nothing else, and says how the set changed since.
        n ? button(`Recover ${n}`, () => act(`Put these ${n} dead letters back to pending? They are spread over time so a receiver is not stampeded.`,
          () => api('POST', '/api/admin/outbox/recover', Object.assign(body(false), { ids: r.would_recover })),
          (res) => {
            const changed = [];
            if (res.changed.length) changed.push(`${res.changed.length} of the preview were no longer dead letters and were left alone`);
            if (res.not_in_preview) changed.push(`${res.not_in_preview} dead letter${res.not_in_preview === 1 ? '' : 's'} matching the filter arrived after the preview and were not touched (preview again to include them)`);
            fill(preview, changed.length ? h('p', { class: 'warn', id: 'recover-changed' }, `The set changed since the preview: ${changed.join('; ')}.`) : null);
            return `Recovered ${res.recovered.length}; skipped ${res.skipped.length}; spread over ${res.over_seconds} s.`;
          }), { class: 'danger', id: 'recover-run' }) : null);
    } catch (e) { say(e.message, true); }
  };
  main.append(h('h1', {}, 'Dead letters'), live);
  if (may('outbox:write')) {
    main.append(h('h2', {}, 'Bulk recover'), form, h('div', { class: 'actions' }, button('Preview', previewRun, { id: 'recover-preview' })), preview);
  }
  return async () => {
    const { groups } = await api('GET', '/api/admin/outbox/dead-letters');
    const total = groups.reduce((n, g) => n + g.count, 0);
    fill(live,
      table(`${total} dead letter${total === 1 ? '' : 's'}, by kind and the class of their last attempt`, [
        { title: 'kind', cell: r => r.kind },
        { title: 'failure class', cell: r => r.class || 'no attempt' },
        { title: 'outcome', cell: r => r.unknown ? h('span', { class: 'warn' }, 'unknown: left out of a recover unless named') : 'known' },
        { title: 'count', num: true, cell: r => r.count },
        { title: 'newest', cell: r => opLink(r.newest) },
        { title: 'all', cell: r => h('a', { href: `#/ops${query({ status: 'failed', kind: r.kind })}` }, `${r.kind} dead letters`) },
      ], groups, 'No dead letters.'));
  };
}

async function destinations(main, live) {
  main.append(h('h1', {}, 'Destinations'), live);
  return async () => {
    const [d, b] = await Promise.all([api('GET', '/api/admin/destinations'), api('GET', '/api/admin/breakers')]);
    const writes = may('outbox:write');
    const suspend = (host) => {
      const reason = window.prompt(`Suspend ${host}: its ops are held until resumed. Reason?`);
      if (!reason) return;
      act(null, () => api('POST', `/api/admin/destinations/${encodeURIComponent(host)}/suspend`, { reason }), () => `${host} is suspended.`);
    };
    const hostInput = h('input', { id: 'suspend-host', placeholder: 'inbox.example:443' });
    fill(live, 
      table('Destination hosts with failures or held', [
        { title: 'host', cell: r => r.host }, { title: 'state', cell: r => r.state },
        { title: 'failures', num: true, cell: r => r.failures ?? '' }, { title: 'since', cell: r => when(r.since || r.first_failure_at) },
        { title: 'last error / reason', cell: r => r.reason || r.last_error || '' }, { title: 'next probe', cell: r => when(r.next_probe_at) },
        { title: 'action', cell: r => writes ? (r.state === 'suspended' || r.state === 'unavailable'
          ? button('Resume', () => act(`Resume ${r.host}?`, () => api('POST', `/api/admin/destinations/${encodeURIComponent(r.host)}/resume`), () => `${r.host} resumed.`))
          : button('Suspend', () => suspend(r.host))) : '' },
      ], d.destinations, 'Every destination is healthy.'),
      writes ? h('div', { class: 'actions' }, h('label', { for: 'suspend-host' }, 'Suspend a host: ', hostInput), button('Suspend', () => hostInput.value.trim() && suspend(hostInput.value.trim()))) : null,
      h('h2', {}, 'Gone inboxes'),
      table('Personal inboxes that answered 410 Gone', [{ title: 'inbox', cell: r => r.inbox }, { title: 'gone at', cell: r => when(r.gone_at) }], d.gone_inboxes, 'None.'),
      h('h2', {}, 'Breakers (this host)'),
      table('Destinations with a failure counted or a breaker open', [
        { title: 'destination', cell: r => r.destination }, { title: 'state', cell: r => r.state },
        { title: 'failures', num: true, cell: r => r.failures }, { title: 'last error', cell: r => r.last_error || '' },
        { title: 'action', cell: r => writes ? (r.state === 'closed'
          ? button('Open', () => act(`Open the breaker of ${r.destination}?`, () => api('POST', `/api/admin/breakers/${encodeURIComponent(r.destination)}/open`), () => 'Opened.'))
          : button('Close', () => act(`Close the breaker of ${r.destination}?`, () => api('POST', `/api/admin/breakers/${encodeURIComponent(r.destination)}/close`), () => 'Closed.'))) : '' },
      ], b.breakers, 'No breaker has counted a failure.'));
  };
}

async function steering(main, live, params) {
  main.append(h('h1', {}, 'Lanes, pauses, subjects'));
  if (may('outbox:write')) {
    const scope = h('select', { id: 'pause-scope', name: 'scope' }, ['kind', 'outbox', 'destination'].map(s => h('option', { value: s }, s)));
    const target = h('input', { id: 'pause-target', name: 'target', required: true });
    const reason = h('input', { id: 'pause-reason', name: 'reason' });
    const subject = h('input', { id: 'halt-subject', name: 'subject', required: true });
    const why = h('input', { id: 'halt-reason', name: 'reason' });
    main.append(
      h('form', { class: 'filters', 'aria-label': 'Pause', onsubmit: (ev) => {
        ev.preventDefault();
        act(null, () => api('POST', '/api/admin/pauses', { scope: scope.value, target: target.value.trim(), reason: reason.value.trim() || null }), () => `Paused ${scope.value} ${target.value.trim()}.`);
      } }, h('label', { for: 'pause-scope' }, 'scope', scope), h('label', { for: 'pause-target' }, 'target', target), h('label', { for: 'pause-reason' }, 'reason', reason), h('button', { type: 'submit', id: 'pause-submit' }, 'Pause')),
      h('form', { class: 'filters', 'aria-label': 'Halt a subject', onsubmit: (ev) => {
        ev.preventDefault();
        act(null, () => api('POST', '/api/admin/subjects/halt', { subject: subject.value.trim(), reason: why.value.trim() || null }), () => `Halted ${subject.value.trim()}.`);
      } }, h('label', { for: 'halt-subject' }, 'subject', subject), h('label', { for: 'halt-reason' }, 'reason', why), h('button', { type: 'submit' }, 'Halt')));
  }
  main.append(live);
  return async () => {
    const [pauses, lanes, subjects] = await Promise.all([
      api('GET', '/api/admin/pauses'),
      api('GET', `/api/admin/lanes${query({ after: params.get('lanes_after'), limit: PAGE })}`),
      api('GET', '/api/admin/subjects')]);
    const nextLanes = new URLSearchParams(params); if (lanes.next !== null) nextLanes.set('lanes_after', lanes.next);
    const firstLanes = new URLSearchParams(params); firstLanes.delete('lanes_after');
    const writes = may('outbox:write');
    fill(live, 
      h('h2', {}, 'Pauses'),
      table('What is paused on every host', [
        { title: 'scope', cell: r => r.scope }, { title: 'target', cell: r => r.target }, { title: 'reason', cell: r => r.reason || '' },
        { title: 'by', cell: r => r.actor }, { title: 'since', cell: r => when(r.paused_at) },
        { title: 'action', cell: r => writes ? button('Resume', () => act(`Resume ${r.scope} ${r.target}?`, () => api('DELETE', `/api/admin/pauses/${encodeURIComponent(r.scope)}/${encodeURIComponent(r.target)}`), () => `Resumed ${r.scope} ${r.target}.`), { 'data-resume': `${r.scope}/${r.target}` }) : '' },
      ], pauses.pauses, 'Nothing is paused.'),
      h('h2', {}, 'Held lanes'),
      table('Strict lanes held behind a dead letter', [
        { title: 'outbox', cell: r => r.outbox }, { title: 'lane', cell: r => r.lane }, { title: 'behind op', cell: r => r.op_id ? opLink(r.op_id) : '' },
        { title: 'since', cell: r => when(r.halted_at) },
        { title: 'action', cell: r => writes ? button('Skip', () => act(`Release lane ${r.lane} past its dead letter? Later ops go on without it.`, () => api('POST', '/api/admin/lanes/skip', { outbox: r.outbox, lane: r.lane }), () => `Released ${r.lane}.`)) : '' },
      ], lanes.held, params.get('lanes_after') ? 'No more held lanes.' : 'No lane is held.'),
      h('p', { class: 'actions' },
        params.get('lanes_after') ? h('a', { href: `#/steering?${firstLanes}` }, 'First held lanes') : null,
        lanes.next !== null ? h('a', { href: `#/steering?${nextLanes}`, rel: 'next', id: 'lanes-next' }, 'More held lanes') : null),
      h('h2', {}, 'Halted subjects'),
      table('Subjects whose ops wait', [
        { title: 'subject', cell: r => r.subject }, { title: 'reason', cell: r => r.reason || '' }, { title: 'since', cell: r => when(r.halted_at) },
        { title: 'action', cell: r => writes ? button('Unhalt', () => act(`Unhalt ${r.subject}?`, () => api('POST', '/api/admin/subjects/unhalt', { subject: r.subject }), () => `Unhalted ${r.subject}.`)) : '' },
      ], subjects.halted, 'No subject is halted.'));
  };
}

async function audit(main, live, params) {
  const filter = h('input', { id: 'audit-filter', value: params.get('q') || '', placeholder: 'actor, action or target' });
  main.append(h('h1', {}, 'Audit'),
    h('form', { class: 'filters', onsubmit: (ev) => { ev.preventDefault(); const p = new URLSearchParams(params); p.delete('before'); p.set('q', filter.value.trim()); location.hash = `#/audit?${p}`; } },
      h('label', { for: 'audit-filter' }, 'contains', filter), h('button', { type: 'submit' }, 'Filter')), live);
  return async () => {
    const page = await api('GET', `/api/admin/audit${query({ before: params.get('before'), limit: 200 })}`);
    const q = (params.get('q') || '').toLowerCase();
    const rows = q ? page.entries.filter(e => `${e.actor} ${e.action} ${e.target}`.toLowerCase().includes(q)) : page.entries;
    const next = new URLSearchParams(params); if (page.next !== null) next.set('before', page.next);
    fill(live, 
      table(q ? `Entries of this page containing “${q}”` : 'Every operator write, newest first', [
        { title: 'when', cell: r => when(r.at) }, { title: 'who', cell: r => r.actor }, { title: 'action', cell: r => r.action }, { title: 'target', cell: r => r.target },
        { title: 'after', cell: r => r.after === null ? '' : h('code', {}, JSON.stringify(r.after).slice(0, 200)) },
      ], rows, 'No entries.'),
      page.next !== null ? h('p', {}, h('a', { href: `#/audit?${next}` }, 'Older')) : null);
  };
}

// ---- routing -------------------------------------------------------------

const PAGES = { '': overview, ops, op, dead, destinations, steering, audit };

async function refresh() {
  // One refresh at a time per page: a slow answer is not overtaken by the
  // next poll (a page just navigated to does not wait for the last one's).
  const current = state.route;
  if (!current || state.refreshing === current) return;
  state.refreshing = current;
  try {
    await current();
    // A refresh that failed said so; one that works takes that back (and
    // leaves what an action reported).
    if (state.refreshFailed) say('');
    state.refreshFailed = false;
  } catch (e) {
    state.refreshFailed = true;
    say(e.message, true);
  } finally {
    if (state.refreshing === current) state.refreshing = null;
  }
}

// Starts or stops the current page's polling (a page whose data is final
// stops it; an action that changes it starts it again).
function polling(on) {
  if (!on) { clearInterval(state.timer); state.timer = null; return; }
  if (state.timer === null && state.interval) {
    state.timer = setInterval(() => { if (!document.hidden) refresh(); }, state.interval);
  }
}

async function route() {
  // A later navigation wins: an earlier one still awaiting stops there.
  const nav = ++state.nav;
  clearInterval(state.timer);
  state.timer = undefined;
  state.interval = null;
  state.route = null;
  const main = document.getElementById('main');
  main.replaceChildren();
  if (!state.key) { signInPage(main); return; }
  if (!state.actor) {
    try { await whoami(); } catch (e) { return; }
    if (nav !== state.nav) return;
  }
  const [path, search] = location.hash.replace(/^#\/?/, '').split('?');
  const [name, arg] = path.split('/');
  const params = new URLSearchParams(search || '');
  for (const a of document.querySelectorAll('nav a')) {
    const target = a.getAttribute('href').replace(/^#\/?/, '');
    if (target === (name === 'op' ? 'ops' : name)) a.setAttribute('aria-current', 'page'); else a.removeAttribute('aria-current');
  }
  const page = PAGES[name];
  if (!page) { main.append(h('h1', {}, 'No such page'), h('p', {}, h('a', { href: '#/' }, 'Overview'))); return; }
  if (!may('outbox:read')) {
    main.append(h('h1', {}, 'Not allowed'), h('p', {}, `This key (${state.actor}) lacks the outbox:read scope the console's pages need.`));
    return;
  }
  const live = h('div', { id: 'live', 'aria-busy': 'false' });
  const refresher = await page(main, live, params, arg);
  if (nav !== state.nav) return;
  state.route = refresher;
  document.title = `${main.querySelector('h1').textContent} · laneway`;
  main.focus();
  await refresh();
  if (nav !== state.nav) return;
  state.interval = page === overview ? OVERVIEW_POLL_MS : POLL_MS;
  if (state.timer === null) return;
  state.timer = setInterval(() => { if (!document.hidden) refresh(); }, state.interval);
}

window.addEventListener('hashchange', () => { say(''); route(); });
route();
