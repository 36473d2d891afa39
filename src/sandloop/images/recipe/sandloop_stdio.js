// stdout and stderr for Node in a sandbox (issue 60; sandloop_stdio.py is Python's): a write that
// comes within CHATTY ms of the one before is kept, and what is kept goes out as one write at most
// FLUSH ms later, at MAX_KEPT bytes, before the other stream's next write (the two keep their
// order), before a child process starts, before the process ends or signals itself, and before a
// session's JS context reports its cell's end (kernel.js calls __sandloopFlush). Why: under
// gVisor's ptrace platform every write that reaches the host costs ~0.2 ms, and console.log
// writes each line (10,000 lines took 2.2 s there, 0.35 s under runc). A line on its own still
// leaves at once. Loaded by NODE_OPTIONS=--require (the image's ENV, and the egress relay's).
"use strict";
(() => {
  if (globalThis.__sandloopFlush) return; // required twice
  const fs = require("fs");
  const CHATTY = 2;
  const FLUSH = 5;
  const MAX_KEPT = 64 * 1024;
  const streams = [];

  function writeAll(fd, data) {
    let off = 0;
    while (off < data.length) {
      try {
        off += fs.writeSync(fd, data, off);
      } catch (err) {
        if (err.code !== "EAGAIN") return; // (a closed stream: what is kept goes nowhere)
      }
    }
  }

  function flushAll() {
    for (const s of streams) s.drain();
  }

  for (const [name, fd] of [["stdout", 1], ["stderr", 2]]) {
    const stream = process[name];
    if (!stream || stream.isTTY) continue; // a terminal: as Node writes it
    const original = stream.write.bind(stream);
    const state = {
      kept: [],
      size: 0,
      last: -Infinity,
      timer: null,
      drain() {
        if (this.timer) {
          clearTimeout(this.timer);
          this.timer = null;
        }
        if (!this.size) return;
        const data = Buffer.concat(this.kept);
        this.kept = [];
        this.size = 0;
        writeAll(fd, data);
      },
    };
    streams.push(state);
    stream.write = function (chunk, encoding, callback) {
      if (typeof encoding === "function") {
        callback = encoding;
        encoding = undefined;
      }
      const now = performance.now();
      for (const other of streams) if (other !== state && other.size) other.drain();
      if (state.size || now - state.last < CHATTY) {
        const data = typeof chunk === "string" ? Buffer.from(chunk, encoding || "utf8") : Buffer.from(chunk);
        state.kept.push(data);
        state.size += data.length;
        state.last = now;
        if (state.size >= MAX_KEPT) state.drain();
        else if (!state.timer) {
          state.timer = setTimeout(() => state.drain(), FLUSH);
          state.timer.unref();
        }
        if (callback) process.nextTick(callback);
        return true;
      }
      state.last = now;
      return original(chunk, encoding, callback);
    };
  }
  if (!streams.length) return;
  globalThis.__sandloopFlush = flushAll;
  process.on("exit", flushAll);
  process.on("uncaughtExceptionMonitor", flushAll);
  const kill = process.kill.bind(process);
  process.kill = (...args) => {
    flushAll();
    return kill(...args);
  };
  const reallyExit = process.reallyExit;
  process.reallyExit = (...args) => {
    flushAll();
    return reallyExit.apply(process, args);
  };
  const childProcess = require("child_process");
  for (const name of ["spawn", "spawnSync", "exec", "execSync", "execFile", "execFileSync", "fork"]) {
    const call = childProcess[name];
    childProcess[name] = function (...args) {
      flushAll();
      return call.apply(this, args);
    };
  }
})();
