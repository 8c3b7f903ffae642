// An ActivityPub inbox for laneway's tests, verifying every POST with
// libraries laneway did not write: joyent's `http-signature` for
// draft-cavage (plus the Digest check it leaves to its caller) and
// `http-message-signatures` for RFC 9421 (plus the Content-Digest check).
//
//   node inbox.js KEYS.json OUT.jsonl [--accept cavage|rfc9421|both] [--challenge]
//
// KEYS.json maps each keyId to {"pem": "...", "alg": "rsa-sha256"|"ed25519"}.
// POSTs to /hooks/... are outcome webhooks instead: with a "whsec_..." secret
// under KEYS.json's "webhook_secret", their Standard Webhooks signature is
// checked, and they are recorded with their webhook-id (and, when the body
// carries one, the id of the activity it hands on, as `inner`).
// With a PEM under KEYS.json's "actor_pem", GET /actors/NAME serves an
// actor document whose key (`#main-key`) is that PEM: the senders of
// signed inbound traffic.
// With --secure-fetch (Mastodon's AUTHORIZED_FETCH), those GETs are served
// only when signed (draft-cavage over (request-target) host date, or RFC 9421
// over @method and @target-uri) by a key found under KEYS.json's keyId or,
// failing that, in the actor document its keyId URL serves (laneway's own
// instance actor); unsigned or badly signed GETs get 401 (and, with
// --challenge, an Accept-Signature asking for RFC 9421).
// Every request is appended to OUT.jsonl as {path, scheme, status, id, why}.
// Paths whose user name starts with "gone" answer 410; "flaky" ones answer
// 503 to their first two POSTs. With --accept, the other scheme gets 401
// (and, with --challenge, an Accept-Signature naming RFC 9421's components).
// Prints the port it listens on, then serves until killed.
'use strict';
const http = require('http');
const crypto = require('crypto');
const fs = require('fs');
const httpSignature = require('http-signature');
const { httpbis, createVerifier } = require('http-message-signatures');

const [keysFile, outFile, ...flags] = process.argv.slice(2);
if (!keysFile || !outFile) {
  console.error('usage: node inbox.js KEYS.json OUT.jsonl [--accept cavage|rfc9421|both] [--challenge]');
  process.exit(2);
}
const keys = JSON.parse(fs.readFileSync(keysFile, 'utf8'));
const acceptAt = flags.indexOf('--accept');
const accept = acceptAt >= 0 ? flags[acceptAt + 1] : 'both';
const challenge = flags.includes('--challenge');
const secureFetch = flags.includes('--secure-fetch');
const seen = new Map();

// The key a fetch names: KEYS.json's, else the one the keyId's own actor
// document lists (fetched, as Mastodon fetches the signer's actor).
async function signerKey(keyId) {
  if (keys[keyId]) return keys[keyId];
  const response = await fetch(keyId.split('#')[0], { headers: { accept: 'application/activity+json' } });
  if (!response.ok) throw new Error(`cannot fetch the signer's actor: HTTP ${response.status}`);
  const doc = await response.json();
  const listed = [].concat(doc.publicKey || []).find((k) => k.id === keyId);
  if (!listed || listed.owner !== doc.id) throw new Error(`the signer's actor does not list ${keyId}`);
  const type = crypto.createPublicKey(listed.publicKeyPem).asymmetricKeyType;
  return { pem: listed.publicKeyPem, alg: type === 'ed25519' ? 'ed25519' : 'rsa-sha256' };
}

async function verifyFetch(req) {
  if (req.headers['signature-input']) {
    const url = `http://${req.headers.host}${req.url}`;
    const ok = await httpbis.verifyMessage(
      {
        keyLookup: async (params) => {
          const key = await signerKey(params.keyid);
          const alg = key.alg === 'ed25519' ? 'ed25519' : 'rsa-v1_5-sha256';
          return { id: params.keyid, algs: [alg], verify: createVerifier(key.pem, alg) };
        },
        requiredParams: ['created', 'keyid'],
        requiredFields: ['@method', '@target-uri'],
        tolerance: 3600,
      },
      { method: req.method, url, headers: req.headers },
    );
    if (ok !== true) throw new Error(`fetch signature not verified (${ok})`);
    return 'rfc9421';
  }
  if (!req.headers['signature']) throw new Error('unsigned fetch');
  const parsed = httpSignature.parseRequest(req, {
    headers: ['(request-target)', 'host', 'date'],
    clockSkew: 3600,
  });
  const key = await signerKey(parsed.keyId);
  if (!httpSignature.verifySignature(parsed, key.pem)) throw new Error('bad fetch signature');
  return 'cavage';
}

async function actor(req, res) {
  const name = (req.url.match(/^\/actors\/([A-Za-z0-9_-]+)$/) || [])[1];
  if (!name || !keys.actor_pem) {
    res.writeHead(404);
    return res.end();
  }
  if (secureFetch) {
    const scheme = req.headers['signature-input'] ? 'rfc9421' : req.headers['signature'] ? 'cavage' : 'none';
    try {
      if (accept !== 'both' && scheme !== accept) throw new Error(`this server accepts ${accept} fetches only`);
      await verifyFetch(req);
      record({ path: req.url, method: 'GET', scheme, status: 200, id: null, why: null, inner: null });
    } catch (e) {
      record({ path: req.url, method: 'GET', scheme, status: 401, id: null, why: String(e.message || e), inner: null });
      const headers = {};
      if (challenge) headers['accept-signature'] = 'sig1=("@method" "@target-uri");alg="rsa-v1_5-sha256"';
      res.writeHead(401, headers);
      return res.end();
    }
  }
  const id = `http://${req.headers.host}/actors/${name}`;
  res.writeHead(200, { 'content-type': 'application/activity+json' });
  res.end(JSON.stringify({
    '@context': ['https://www.w3.org/ns/activitystreams', 'https://w3id.org/security/v1'],
    id,
    type: 'Person',
    inbox: `${id}/inbox`,
    publicKey: { id: `${id}#main-key`, owner: id, publicKeyPem: keys.actor_pem },
  }));
}

function inner(body) {
  try {
    const parsed = JSON.parse(body.toString('utf8'));
    return (parsed && parsed.activity && parsed.activity.id) || null;
  } catch (e) {
    return null;
  }
}

function record(entry) {
  fs.appendFileSync(outFile, JSON.stringify(entry) + '\n');
}

function sha256(body) {
  return crypto.createHash('sha256').update(body).digest('base64');
}

function verifyCavage(req, body) {
  const parsed = httpSignature.parseRequest(req, {
    headers: ['(request-target)', 'host', 'date', 'digest'],
    clockSkew: 3600,
  });
  const key = keys[parsed.keyId];
  if (!key) throw new Error(`unknown keyId ${parsed.keyId}`);
  if (!httpSignature.verifySignature(parsed, key.pem)) throw new Error('bad signature');
  if (req.headers['digest'] !== `SHA-256=${sha256(body)}`) throw new Error('digest mismatch');
}

async function verifyRfc9421(req, body) {
  const url = `http://${req.headers.host}${req.url}`;
  const ok = await httpbis.verifyMessage(
    {
      keyLookup: async (params) => {
        const key = keys[params.keyid];
        if (!key) return null;
        const alg = key.alg === 'ed25519' ? 'ed25519' : 'rsa-v1_5-sha256';
        return { id: params.keyid, algs: [alg], verify: createVerifier(key.pem, alg) };
      },
      requiredParams: ['created', 'keyid'],
      requiredFields: ['@method', '@target-uri', 'content-digest'],
      tolerance: 3600,
    },
    { method: req.method, url, headers: req.headers },
  );
  if (ok !== true) throw new Error(`signature not verified (${ok})`);
  if (req.headers['content-digest'] !== `sha-256=:${sha256(body)}:`) throw new Error('content-digest mismatch');
}

// Standard Webhooks v1: HMAC-SHA256 over "id.timestamp.body" with the
// base64 secret after "whsec_"; any of the space-separated v1 signatures.
function verifyWebhook(req, body) {
  const id = req.headers['webhook-id'];
  const timestamp = req.headers['webhook-timestamp'];
  const signatures = (req.headers['webhook-signature'] || '').split(' ');
  if (!id || !timestamp) return [400, 'webhook-id and webhook-timestamp are required', id];
  const secret = keys.webhook_secret;
  if (secret) {
    const mac = crypto
      .createHmac('sha256', Buffer.from(secret.replace(/^whsec_/, ''), 'base64'))
      .update(`${id}.${timestamp}.${body.toString('utf8')}`)
      .digest('base64');
    if (!signatures.includes(`v1,${mac}`)) return [401, 'bad webhook signature', id];
  }
  return [204, null, id];
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', async () => {
    const body = Buffer.concat(chunks);
    const scheme = req.headers['signature-input'] ? 'rfc9421' : req.headers['signature'] ? 'cavage' : 'none';
    const answer = (status, why, id, handedOn) => {
      record({ path: req.url, scheme, status, id: id || null, why: why || null, inner: handedOn || null });
      const headers = {};
      if (status === 401 && challenge) {
        headers['accept-signature'] = 'sig1=("@method" "@target-uri" "content-type" "content-digest");alg="rsa-v1_5-sha256"';
      }
      res.writeHead(status, headers);
      res.end(why ? JSON.stringify({ error: why }) : '');
    };
    if (req.method === 'GET') return actor(req, res).catch(() => answer(500, 'actor failed'));
    if (req.method !== 'POST') return answer(405, 'POST only');
    if (req.url.startsWith('/hooks/')) return answer(...verifyWebhook(req, body), inner(body));
    if (accept !== 'both' && scheme !== accept) return answer(401, `this inbox accepts ${accept} signatures only`);
    try {
      if (scheme === 'cavage') verifyCavage(req, body);
      else if (scheme === 'rfc9421') await verifyRfc9421(req, body);
      else throw new Error('no signature');
    } catch (e) {
      return answer(401, String(e.message || e));
    }
    let id = null;
    try {
      id = JSON.parse(body.toString('utf8')).id || null;
    } catch (e) {
      return answer(400, 'body is not JSON');
    }
    const user = (req.url.match(/\/users\/([^/]+)\//) || [])[1] || '';
    if (user.startsWith('gone')) return answer(410, 'gone', id);
    if (user.startsWith('flaky')) {
      const n = (seen.get(req.url) || 0) + 1;
      seen.set(req.url, n);
      if (n <= 2) return answer(503, 'try later', id);
    }
    answer(202, null, id);
  });
});

server.listen(0, '127.0.0.1', () => {
  console.log(server.address().port);
});
