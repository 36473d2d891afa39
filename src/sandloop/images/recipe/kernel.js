// A JavaScript or TypeScript context of a session (see kernel.py): one node process whose
// globals persist from cell to cell.
//
// Each cell is evaluated by node's own REPL evaluator (repl.start().eval): top-level await,
// `require`, the last expression's value (util.inspect'ed as text/plain), declarations kept for the
// next cell. Static `import` lines become `await import(...)` (a REPL script is not a module).
// TypeScript is first transpiled by the `typescript` package shipped in the image
// (transpileModule: types are erased, nothing is type-checked). A cell without `await` runs as a
// vm.Script with breakOnSigint, so SIGINT breaks even a busy loop and the context lives on; SIGINT
// abandons a cell that is awaiting (the context lives on too). Only a busy loop in a cell that
// also awaits cannot be broken: the supervisor replaces that context after its grace period.
//
// Cells arrive on fd SANDLOOP_CELL_FD (a JSON line, then the code); one JSON line per cell goes
// back on SANDLOOP_REPLY_FD. Output goes straight to stdout and stderr.
"use strict";
const fs = require("fs");
const repl = require("repl");
const util = require("util");
const vm = require("vm");
const { PassThrough } = require("stream");

const CELL_FD = Number(process.env.SANDLOOP_CELL_FD);
const REPLY_FD = Number(process.env.SANDLOOP_REPLY_FD);
const LANGUAGE = process.env.SANDLOOP_LANGUAGE || "javascript";
delete process.env.SANDLOOP_CELL_FD;
delete process.env.SANDLOOP_REPLY_FD;
delete process.env.SANDLOOP_LANGUAGE;
const MAX_VALUE_CHARS = 20000;

const server = repl.start({
  input: new PassThrough(),
  output: new PassThrough(),
  terminal: false,
  prompt: "",
  useGlobal: true,
  // Not breakEvalOnSigint (measured: it does not break a busy loop here, and SIGINT then kills
  // the context): a cell without `await` runs as a vm.Script with breakOnSigint instead (run()).
  breakEvalOnSigint: false,
});
let executionCount = 0;
let current = null; // { finish } of the running cell
// The REPL reports a cell's exception to its domain, not to the eval callback (node 18 and 20).
server._domain.removeAllListeners("error");
server._domain.on("error", (err) => {
  if (current) current.fail(err);
  else process.stderr.write(`Uncaught ${err && err.stack ? err.stack : err}\n`);
});

let ts = null;
function transpile(code) {
  if (ts === null) ts = require("typescript");
  return ts.transpileModule(code, {
    compilerOptions: {
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext,
      verbatimModuleSyntax: false,
      isolatedModules: true,
    },
    reportDiagnostics: false,
  }).outputText;
}

// import X from "m" | import * as X from "m" | import {a, b as c} from "m" | import X, {a} from "m" | import "m"
const IMPORT = /^[ \t]*import\s+(?:(?:([\w$]+)\s*,?\s*)?(?:\*\s+as\s+([\w$]+)|\{([^}]*)\})?\s*from\s*)?(['"][^'"]+['"])\s*;?[ \t]*$/gm;
// Top-level `const x` / `let x` (at the start of a line) become `var x`: a cell can run again.
const DECLARATION = /^(const|let)(\s+[\w$[{])/gm;
function rewrite(code) {
  return code.replace(DECLARATION, "var$2").replace(IMPORT, (line, def, star, names, spec) => {
    const parts = [];
    const tmp = `__sandloop_m${Math.random().toString(36).slice(2, 8)}`;
    parts.push(`var ${tmp} = await import(${spec});`);
    if (def) parts.push(`var ${def} = ${tmp}.default !== undefined ? ${tmp}.default : ${tmp};`);
    if (star) parts.push(`var ${star} = ${tmp};`);
    if (names) {
      for (const item of names.split(",").map((s) => s.trim()).filter(Boolean)) {
        const [name, alias] = item.split(/\s+as\s+/).map((s) => s.trim());
        if (name === "type" || name.startsWith("type ")) continue;
        parts.push(`var ${alias || name} = ${tmp}[${JSON.stringify(name)}];`);
      }
    }
    return parts.join(" ");
  });
}

function reply(message) {
  if (globalThis.__sandloopFlush) globalThis.__sandloopFlush(); // the cell's output before its end
  const data = Buffer.from(JSON.stringify(message) + "\n");
  let off = 0;
  while (off < data.length) off += fs.writeSync(REPLY_FD, data, off);
}

function errorOf(err) {
  if (err && typeof err === "object") {
    return {
      name: String(err.name || "Error"),
      value: String(err.message === undefined ? err : err.message),
      traceback: String(err.stack || err),
    };
  }
  return { name: "Error", value: String(err), traceback: String(err) };
}

function run(header, code) {
  const env = header.env || {};
  const saved = {};
  for (const [k, v] of Object.entries(env)) {
    saved[k] = process.env[k];
    process.env[k] = String(v);
  }
  executionCount += 1;
  let done = false;
  const finish = (status, outputs, error) => {
    if (done) return;
    done = true;
    current = null;
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
    const message = { status, outputs, execution_count: executionCount, error };
    const main = outputs.find((o) => o.type === "execute_result");
    if (main) {
      let text = main.data["text/plain"];
      const omitted = Math.max(0, text.length - MAX_VALUE_CHARS);
      if (omitted) text = text.slice(0, MAX_VALUE_CHARS) + `... [${omitted} characters omitted]`;
      message.value = text;
      message.value_omitted = omitted;
    }
    reply(message);
  };
  const fail = (err) => {
    const interrupted = /interrupted/i.test(String(err && err.message));
    if (!interrupted) process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
    finish(interrupted ? 130 : 1, [], interrupted ? { name: "KeyboardInterrupt", value: "", traceback: "" } : errorOf(err));
  };
  current = { finish, fail };
  let source;
  try {
    source = LANGUAGE === "typescript" ? transpile(code) : code;
    source = rewrite(source);
  } catch (err) {
    process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
    finish(1, [], errorOf(err));
    return;
  }
  const evaluated = (err, value) => {
    if (err) {
      fail(err);
      return;
    }
    const outputs = [];
    if (value !== undefined) {
      const text = util.inspect(value, { depth: 4, maxArrayLength: 200, breakLength: 100 });
      const data = { "text/plain": text };
      if (value !== null && typeof value === "object") {
        try {
          const json = JSON.parse(JSON.stringify(value));
          if (json !== null && typeof json === "object") data["application/json"] = json;
        } catch (_) {}
      }
      outputs.push({ type: "execute_result", data, metadata: {} });
    }
    finish(0, outputs, null);
  };
  if (AWAIT.test(source)) {
    server.eval(source, server.context, `cell-${executionCount}`, evaluated);
    return;
  }
  let value;
  try {
    const script = new vm.Script(/^\s*\{/.test(source) && !/;\s*$/.test(source) ? wrapObject(source) : source, {
      filename: `cell-${executionCount}`,
    });
    value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  } catch (err) {
    armSigint(); // breakOnSigint's watchdog leaves SIGINT's default action behind: take it back
    evaluated(err);
    return;
  }
  armSigint();
  evaluated(null, value);
}

// A cell that awaits goes to the REPL's evaluator (it wraps top-level await); one that does not
// runs as a script, which SIGINT can break.
const AWAIT = /\bawait\b/;
// `{a: 1}` alone is an object, as the REPL reads it, not a block.
function wrapObject(source) {
  try {
    new vm.Script(`(${source})`);
    return `(${source})`;
  } catch (_) {
    return source;
  }
}

function onSigint() {
  if (current) current.finish(130, [], { name: "KeyboardInterrupt", value: "", traceback: "" });
}
function armSigint() {
  process.removeListener("SIGINT", onSigint);
  process.on("SIGINT", onSigint);
}
armSigint();
process.on("uncaughtException", (err) => {
  process.stderr.write(`Uncaught ${err && err.stack ? err.stack : err}\n`);
});
process.on("unhandledRejection", (err) => {
  process.stderr.write(`Unhandled rejection: ${err && err.stack ? err.stack : err}\n`);
});

let buffered = Buffer.alloc(0);
const input = fs.createReadStream(null, { fd: CELL_FD });
input.on("data", (chunk) => {
  buffered = Buffer.concat([buffered, chunk]);
  for (;;) {
    const nl = buffered.indexOf(10);
    if (nl < 0) return;
    const header = JSON.parse(buffered.subarray(0, nl).toString());
    const size = Number(header.code || 0);
    if (buffered.length < nl + 1 + size) return;
    const code = buffered.subarray(nl + 1, nl + 1 + size).toString();
    buffered = buffered.subarray(nl + 1 + size);
    run(header, code);
  }
});
input.on("end", () => process.exit(0));
