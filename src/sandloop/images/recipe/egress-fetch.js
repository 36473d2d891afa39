// Inside a sandbox with an egress allowlist (loaded by NODE_OPTIONS=--require): Node's fetch
// (undici, bundled in Node 18) ignores HTTP(S)_PROXY, so route it through sandloop's relay.
// undici keeps its default dispatcher on globalThis under a well-known symbol; this replaces it
// with an Agent of the same class whose connections are CONNECT tunnels through the proxy. The
// http and https modules keep their own (env-less) behaviour: they have no route out.
'use strict';
const net = require('net');
const tls = require('tls');

const proxyUrl = process.env.HTTPS_PROXY || process.env.HTTP_PROXY;
const SYMBOL = Symbol.for('undici.globalDispatcher.1');

function tunnel(opts, callback) {
  const proxy = new URL(proxyUrl);
  const https = opts.protocol === 'https:';
  const port = Number(opts.port) || (https ? 443 : 80);
  const target = `${opts.hostname}:${port}`;
  const sock = net.connect(Number(proxy.port), proxy.hostname);
  let done = false;
  const finish = (err, s) => { if (!done) { done = true; callback(err, s); } };
  sock.once('error', (err) => finish(err));
  sock.once('connect', () => sock.write(`CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`));
  let buf = Buffer.alloc(0);
  const onData = (chunk) => {
    buf = Buffer.concat([buf, chunk]);
    const end = buf.indexOf('\r\n\r\n');
    if (end < 0) return;
    const status = buf.subarray(0, end).toString().split(' ')[1];
    if (status !== '200') {
      sock.once('end', () => {
        const why = buf.subarray(end + 4).toString().trim() || `status ${status}`;
        sock.destroy();
        finish(new Error(why));
      });
      return;
    }
    sock.removeListener('data', onData);
    if (!https) { finish(null, sock); return; }
    const secure = tls.connect({ socket: sock, servername: opts.servername || opts.hostname, ALPNProtocols: ['http/1.1'] });
    secure.once('secureConnect', () => finish(null, secure));
    secure.once('error', (err) => finish(err));
  };
  sock.on('data', onData);
}

if (proxyUrl && typeof globalThis.fetch === 'function') {
  // The first call loads undici (synchronously), which installs its default Agent; its property
  // stays writable, so ours replaces it. The call itself (a data: URL) does nothing else, and the
  // experimental-feature warning it would print is held back: the program's own first fetch says it.
  const emitWarning = process.emitWarning;
  process.emitWarning = () => {};
  try {
    globalThis.fetch('data:,').catch(() => {});
  } finally {
    process.emitWarning = emitWarning;
  }
  const Agent = globalThis[SYMBOL] && globalThis[SYMBOL].constructor;
  if (Agent) globalThis[SYMBOL] = new Agent({ connect: tunnel });
}
