// Preloaded (node --require) by tests/integration/test_e2b_js.py: every TCP connection this
// process opens must go to loopback. A connection anywhere else throws before a packet is sent,
// so a wrong E2B_API_URL or SDK default (api.e2b.app) fails the test instead of leaving the machine.
"use strict";
const net = require("node:net");
const LOOPBACK = /^(127\.\d+\.\d+\.\d+|::1|localhost|[a-z0-9-]+\.localhost)$/i;
const connect = net.Socket.prototype.connect;
net.Socket.prototype.connect = function (...args) {
  const first = args[0];
  const options = Array.isArray(first) ? first[0] : first;
  const host = typeof options === "object" && options !== null ? options.host ?? options.path : args[1];
  if (typeof options === "object" && options !== null && options.path && !options.host) {
    return connect.apply(this, args); // a Unix socket never leaves the machine
  }
  if (!LOOPBACK.test(String(host ?? "localhost"))) {
    throw new Error(`loopback-only: refused a connection to ${host}`);
  }
  return connect.apply(this, args);
};
