"use strict";
// The playground: a small notebook over the HTTP API. A separate file, like the editor it loads:
// the page's CSP allows scripts from this origin only.

const $ = (id) => document.getElementById(id);
const MODES = { python: "python", node: "javascript", bash: "shell" };
const IMAGE = /\.(png|jpe?g|gif|svg|webp)$/i;

let session = localStorage.getItem("sandloop-session") || null;
let filesPath = ".";
let runCount = 0;
const cells = [];

$("token").value = localStorage.getItem("sandloop-token") || "";
$("token").addEventListener("change", () => {
  localStorage.setItem("sandloop-token", $("token").value.trim());
  start();
});

function headers(extra) {
  return { Authorization: "Bearer " + $("token").value.trim(), ...(extra || {}) };
}

async function failure(res) {
  const text = await res.text();
  let data = null;
  try { data = JSON.parse(text); } catch (e) { data = { message: text }; }
  return new Error(`${res.status} ${data && data.code ? data.code + ": " : ""}${(data && data.message) || ""}`);
}

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!res.ok) throw await failure(res);
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

async function raw(method, path, body) {
  const res = await fetch(path, { method, headers: headers(), body });
  if (!res.ok) throw await failure(res);
  return res;
}

// POST a JSON body and read the server-sent events of the answer (``signal`` aborts it: the
// server then interrupts a session's cell).
async function sse(path, body, onEvent, signal) {
  const res = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!res.ok) throw await failure(res);
  await readEvents(res, onEvent);
}

// The server-sent events of an answer, each as onEvent(kind, data) (data parsed from JSON).
async function readEvents(res, onEvent) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const kind = (block.match(/^event: (.*)$/m) || [])[1];
      if (kind === undefined) continue; // a keepalive comment
      const data = JSON.parse((block.match(/^data: (.*)$/m) || [])[1] || "{}");
      onEvent(kind, data);
    }
  }
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const c of children) node.append(c);
  return node;
}

// -- cells ------------------------------------------------------------------------------------
function cellsKey() { return "sandloop-cells:" + (session || "none"); }

// What a cell showed, kept with its code so that a reload shows it again.
function outputOf(cell) {
  const charts = part(cell, "charts").innerHTML; // only ever built by renderOutputs (sandboxed frames, images)
  return {
    stdout: part(cell, "stdout").textContent,
    stderr: part(cell, "stderr").textContent,
    value: part(cell, "value").textContent,
    notes: [...part(cell, "notes").children].map((n) => n.textContent),
    status: part(cell, "status").textContent,
    statusClass: part(cell, "status").className,
    prompt: part(cell, "prompt").textContent,
    duration: part(cell, "duration").textContent,
    charts,
  };
}

function restoreOutput(cell, o) {
  if (!o) return;
  for (const name of ["stdout", "stderr", "value", "prompt", "duration"]) part(cell, name).textContent = o[name] || "";
  for (const n of o.notes || []) part(cell, "notes").append(el("div", { className: "note", textContent: n }));
  if (typeof o.charts === "string") {
    part(cell, "charts").innerHTML = o.charts;
    for (const frame of part(cell, "charts").querySelectorAll("iframe")) fitFrame(frame);
  } else for (const c of o.charts || []) part(cell, "charts").append(el("img", { alt: c.alt, src: c.src }));
  part(cell, "status").textContent = o.status || "";
  part(cell, "status").className = o.statusClass || "status";
}

function saveCells() {
  let saved = cells.map((c) => ({ code: c.cm.getValue(), language: c.lang.value, output: outputOf(c) }));
  try {
    localStorage.setItem(cellsKey(), JSON.stringify(saved));
  } catch (e) { // over the browser's storage quota (big charts): keep the code and the text
    saved = saved.map((c) => ({ ...c, output: { ...c.output, charts: "" } }));
    try { localStorage.setItem(cellsKey(), JSON.stringify(saved)); } catch (e2) { /* code only is lost too */ }
  }
}

function addCell(code, language, output) {
  const node = $("cell-template").content.firstElementChild.cloneNode(true);
  $("cells").append(node);
  const lang = node.querySelector(".lang");
  lang.value = language || $("language").value;
  const cm = CodeMirror(node.querySelector(".editor"), {
    value: code || "",
    mode: MODES[lang.value],
    theme: "material-darker",
    lineNumbers: true,
    matchBrackets: true,
    autoCloseBrackets: true,
    viewportMargin: Infinity,
    indentUnit: 4,
    extraKeys: { "Shift-Enter": () => runCell(cell), Tab: (ed) => ed.execCommand("insertSoftTab") },
  });
  const cell = { node, cm, lang, running: null };
  restoreOutput(cell, output);
  cm.on("change", saveCells);
  lang.addEventListener("change", () => { cm.setOption("mode", MODES[lang.value]); saveCells(); });
  node.querySelector(".run").addEventListener("click", () => (cell.running ? cell.running.abort() : runCell(cell)));
  node.querySelector(".remove").addEventListener("click", () => {
    cells.splice(cells.indexOf(cell), 1);
    node.remove();
    saveCells();
  });
  cells.push(cell);
  return cell;
}

function loadCells() {
  for (const c of cells.splice(0)) c.node.remove();
  let saved = null;
  try { saved = JSON.parse(localStorage.getItem(cellsKey()) || "null"); } catch (e) { saved = null; }
  // The first page: a notebook whose two cells show a value and a chart once run (in a session
  // the last expression is shown; plt.show() leaves the figure to be returned as a PNG).
  const start = saved && saved.length ? saved : [
    { code: "import numpy as np\nprint('hello from the sandbox')\nnp.arange(10).reshape(2, 5)", language: "python" },
    { code: "import matplotlib.pyplot as plt\nxs = list(range(10))\nplt.plot(xs, [x * x for x in xs])\nplt.title('squares')\nplt.show()", language: "python" },
  ];
  for (const c of start) {
    if (typeof c === "string") addCell(c, "python");
    else addCell(c.code, c.language, c.output);
  }
}

function part(cell, name) { return cell.node.querySelector("." + name); }

function setStatus(cell, text, cls) {
  const s = part(cell, "status");
  s.textContent = text;
  s.className = "status " + (cls || "");
}

// A frame for HTML a cell displayed: sandboxed with no scripts (allow-same-origin only lets this
// page measure it), so a table renders and nothing in it runs or reaches the token.
function fitFrame(frame) {
  const fit = () => {
    try { frame.style.height = Math.min(600, frame.contentDocument.documentElement.scrollHeight + 4) + "px"; } catch (e) {}
  };
  frame.addEventListener("load", fit);
  fit();
}

// What a cell displayed (IPython's outputs, each a MIME bundle): the richest format each has,
// the plain text where it has nothing else. Returns whether the main result was shown.
function renderOutputs(cell, outputs) {
  const box = part(cell, "charts");
  let shownMain = false;
  for (const o of outputs || []) {
    const d = o.data || {};
    let node = null;
    if (d["image/png"] || d["image/jpeg"]) {
      const mime = d["image/png"] ? "image/png" : "image/jpeg";
      node = el("img", { alt: d["text/plain"] || mime, src: `data:${mime};base64,${d[mime]}` });
    } else if (d["image/svg+xml"]) {
      const svg = btoa(unescape(encodeURIComponent(d["image/svg+xml"])));
      node = el("img", { alt: "svg", src: `data:image/svg+xml;base64,${svg}` });
    } else if (d["text/html"]) {
      node = el("iframe", { className: "html-output", title: "HTML output" });
      node.setAttribute("sandbox", "allow-same-origin");
      node.setAttribute("srcdoc", `<style>body{font:13px system-ui,sans-serif;margin:4px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}</style>${d["text/html"]}`);
      fitFrame(node);
    } else if (o.type !== "execute_result" && (d["text/markdown"] || d["text/plain"])) {
      node = el("pre", { className: "display-text", textContent: d["text/markdown"] || d["text/plain"] });
    }
    if (node) {
      box.append(node);
      if (o.type === "execute_result") shownMain = true;
    }
  }
  return shownMain;
}

function showResult(cell, r, streamed) {
  if (!streamed) {
    part(cell, "stdout").textContent = r.stdout;
    part(cell, "stderr").textContent = r.stderr;
  }
  part(cell, "value").textContent = r.value === undefined || r.value === null ? "" : r.value;
  const notes = part(cell, "notes");
  for (const n of (r.notes || []).concat(r.interpreter_restarted ? ["the interpreter was restarted: variables are gone"] : [])) {
    notes.append(el("div", { className: "note", textContent: "⚠ " + n }));
  }
  if (r.outputs) {
    // a streamed cell drew its outputs as they came (`display` events); the others draw them now
    const shownMain = streamed ? cell.shownMain : renderOutputs(cell, r.outputs);
    if (shownMain) part(cell, "value").textContent = ""; // shown richer above
  } else {
    for (const a of r.artifacts || []) {
      part(cell, "charts").append(el("img", { alt: a.name, src: `data:${a.mime_type};base64,${a.data_base64}` }));
    }
  }
  setStatus(cell, r.timed_out ? "timed out" : `exit ${r.exit_code}`, r.ok ? "ok" : "bad");
  part(cell, "duration").textContent = `${(r.duration_seconds * 1000).toFixed(0)} ms`;
}

async function runCell(cell) {
  if (cell.running) return;
  const button = part(cell, "run");
  const controller = new AbortController();
  cell.running = controller;
  button.textContent = "■ Stop";
  button.title = "interrupt this cell (a session's variables are kept)";
  cell.node.classList.add("running");
  for (const name of ["stdout", "stderr", "value"]) part(cell, name).textContent = "";
  part(cell, "notes").innerHTML = "";
  part(cell, "charts").innerHTML = "";
  cell.shownMain = false;
  part(cell, "duration").textContent = "";
  setStatus(cell, "running…", "muted");
  part(cell, "prompt").textContent = "[*]";
  const code = cell.cm.getValue();
  const language = cell.lang.value;
  const timeout = Number($("timeout").value);
  try {
    let result = null;
    let path;
    let body;
    if (session) { // every language has a stateful interpreter in a session (its default context)
      path = `/v1/sessions/${session}/cells`;
      body = { code, language, timeout_seconds: timeout, stream: true };
    } else {
      path = "/v1/runs";
      body = {
        code, language, timeout_seconds: timeout, stdin: $("stdin").value || null, stream: true,
        limits: { memory: $("memory").value, runtime: $("runtime").value }, template: $("template").value || null,
      };
    }
    await sse(path, body, (kind, data) => {
      if (kind === "stdout" || kind === "stderr") part(cell, kind).textContent += data.text;
      else if (kind === "display") cell.shownMain = renderOutputs(cell, [data]) || cell.shownMain;
      else if (kind === "result") result = data;
      else if (kind === "error") throw new Error(`${data.code}: ${data.message}`);
    }, controller.signal);
    if (!result) throw new Error("the run ended without a result");
    showResult(cell, result, true);
    part(cell, "prompt").textContent = `[${++runCount}]`;
    if (session) refreshFiles();
  } catch (e) {
    if (controller.signal.aborted) {
      setStatus(cell, session ? "interrupted (variables kept)" : "stopped", "bad");
      part(cell, "prompt").textContent = "[!]";
    } else {
      setStatus(cell, e.message, "bad");
      part(cell, "prompt").textContent = "[!]";
    }
  } finally {
    cell.running = null;
    button.textContent = "▶ Run";
    button.title = "";
    cell.node.classList.remove("running");
    saveCells();
  }
}

$("add-cell").addEventListener("click", () => addCell("").cm.focus());
$("run-all").addEventListener("click", async () => { for (const c of cells.slice()) await runCell(c); });

// -- sessions ---------------------------------------------------------------------------------
let paused = {}; // session id -> what its pause kept ("memory", "state", "files"), from the list

function showSession() {
  $("session-id").textContent = session ? (paused[session] ? `${session} (paused: ${paused[session]} kept)` : session) : "none";
  $("delete-session").disabled = $("detach-session").disabled = !session;
  $("pause-session").disabled = $("fork-session").disabled = !session;
  $("pause-session").textContent = session && paused[session] ? "Resume" : "Pause";
  $("mode").textContent = session
    ? `Session ${session}: each language keeps one interpreter (python, node and bash variables persist); files are in /workspace.`
    : "No session: each cell runs once in a fresh sandbox, its output streaming in. Create a session to keep state and files.";
  for (const li of $("sessions").children) li.classList.toggle("current", li.dataset.id === session);
  showReach();
}

function attach(id) {
  saveCells();
  session = id;
  filesPath = ".";
  if (id) localStorage.setItem("sandloop-session", id);
  else localStorage.removeItem("sandloop-session");
  loadCells();
  showSession();
  refreshFiles();
}

// Templates this token may use (its own and the operator's): new runs and sessions start from the chosen one.
async function refreshTemplates() {
  const select = $("template");
  const chosen = select.value;
  let found = [];
  try { found = await api("GET", "/v1/templates"); } catch (e) { return; }
  select.replaceChildren(el("option", { value: "", textContent: "runtime image" }));
  for (const t of found) select.append(el("option", { value: t.ref, textContent: t.ref }));
  select.value = found.some((t) => t.ref === chosen) ? chosen : "";
}

async function refreshSessions() {
  refreshTemplates();
  const list = $("sessions");
  list.innerHTML = "";
  let mine = [];
  try { mine = await api("GET", "/v1/sessions"); } catch (e) { list.append(el("li", { className: "bad", textContent: e.message })); return; }
  paused = {};
  for (const s of mine) {
    if (s.paused) paused[s.id] = s.paused;
    const open = el("button", { className: "plain", textContent: "open" });
    open.addEventListener("click", () => attach(s.id));
    const label = `${s.id} · ${Math.round(s.quota_bytes / 1048576)}m${s.paused ? " · paused" : ""}`;
    const li = el("li", {}, el("span", { textContent: label }), open);
    li.dataset.id = s.id;
    list.append(li);
  }
  if (session && !mine.some((s) => s.id === session)) attach(null); // expired or deleted elsewhere
  showSession();
}

$("new-session").addEventListener("click", async () => {
  $("new-session").disabled = true;
  try {
    const s = await api("POST", "/v1/sessions", {
      ttl_seconds: 3600, quota: "64m", limits: { memory: $("memory").value, runtime: $("runtime").value },
      template: $("template").value || null,
    });
    attach(s.id);
    await refreshSessions();
  } catch (e) {
    $("session-id").textContent = e.message;
  } finally {
    $("new-session").disabled = false;
  }
});
$("detach-session").addEventListener("click", () => attach(null));
// Pause keeps the interpreter's memory on gVisor, its picklable variables on runc; resume brings them back.
$("pause-session").addEventListener("click", async () => {
  if (!session) return;
  const button = $("pause-session");
  button.disabled = true;
  try {
    await api("POST", `/v1/sessions/${session}/${paused[session] ? "resume" : "pause"}`);
  } catch (e) { $("session-id").textContent = e.message; }
  await refreshSessions();
});
// A fork starts as this session is now (its files and variables copied); the notebook goes with it.
$("fork-session").addEventListener("click", async () => {
  if (!session) return;
  $("fork-session").disabled = true;
  try {
    const [child] = await api("POST", `/v1/sessions/${session}/fork`, { count: 1 });
    saveCells();
    const notebook = localStorage.getItem(cellsKey());
    if (notebook) localStorage.setItem("sandloop-cells:" + child.id, notebook);
    attach(child.id);
  } catch (e) { $("session-id").textContent = e.message; }
  await refreshSessions();
});
$("delete-session").addEventListener("click", async () => {
  if (!session) return;
  const id = session;
  if (!confirm(`Delete session ${id}? Its interpreter, its variables and the files in /workspace are removed for good.`)) return;
  try { await api("DELETE", `/v1/sessions/${id}`); } catch (e) { $("session-id").textContent = e.message; return; }
  localStorage.removeItem("sandloop-cells:" + id);
  attach(null);
  await refreshSessions();
});

// -- files ------------------------------------------------------------------------------------
function joinPath(dir, name) { return dir === "." ? name : `${dir}/${name}`; }
function filesUrl(path) { return `/v1/sessions/${session}/files/${path.split("/").map(encodeURIComponent).join("/")}`; }

async function refreshFiles() {
  const tbody = $("files").querySelector("tbody");
  tbody.innerHTML = "";
  if (!session) return;
  let entries = [];
  try { entries = await api("GET", `/v1/sessions/${session}/files?path=${encodeURIComponent(filesPath)}`); }
  catch (e) { tbody.append(el("tr", {}, el("td", { className: "bad", textContent: e.message }))); return; }
  if (filesPath !== ".") {
    const up = el("tr", {}, el("td", { textContent: "⬑ ..", colSpan: 3 }));
    up.addEventListener("click", () => { filesPath = filesPath.split("/").slice(0, -1).join("/") || "."; refreshFiles(); });
    tbody.append(up);
  }
  for (const f of entries) {
    const path = joinPath(filesPath, f.name);
    const name = el("td", { textContent: (f.type === "dir" ? "▸ " : "") + f.name });
    name.dataset.name = f.name;
    name.style.cursor = "pointer";
    name.addEventListener("click", () => (f.type === "dir" ? ((filesPath = path), refreshFiles()) : preview(path)));
    const actions = el("td", { className: "actions" });
    if (f.type === "file") {
      const get = el("button", { className: "plain", textContent: "⬇", title: "download" });
      get.addEventListener("click", () => download(path));
      actions.append(get);
    }
    const del = el("button", { className: "plain", textContent: "✕", title: "delete" });
    del.addEventListener("click", async () => {
      if (!confirm(`Delete ${path} from the session's workspace?`)) return;
      await raw("DELETE", filesUrl(path));
      refreshFiles();
    });
    actions.append(del);
    tbody.append(el("tr", {}, name, el("td", { className: "muted", textContent: f.type === "dir" ? "" : f.size }), actions));
  }
}

async function download(path) {
  const blob = await (await raw("GET", filesUrl(path))).blob();
  const a = el("a", { href: URL.createObjectURL(blob), download: path.split("/").pop() });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

async function preview(path) {
  const box = $("preview");
  box.innerHTML = "";
  try {
    const blob = await (await raw("GET", filesUrl(path))).blob();
    box.append(el("div", { className: "muted", textContent: path }));
    if (IMAGE.test(path)) {
      box.append(el("img", { alt: path, src: URL.createObjectURL(blob.slice(0, blob.size, path.endsWith(".svg") ? "image/svg+xml" : "")) }));
    } else {
      const text = await blob.slice(0, 100000).text();
      box.append(el("pre", { textContent: text + (blob.size > 100000 ? "\n… (first 100 KB)" : "") }));
    }
  } catch (e) {
    box.append(el("div", { className: "bad", textContent: e.message }));
  }
}

$("upload").addEventListener("change", async (ev) => {
  if (!session) { $("preview").textContent = "create or open a session first"; return; }
  for (const file of ev.target.files) {
    try { await raw("PUT", filesUrl(joinPath(filesPath, file.name)), file); }
    catch (e) { $("preview").textContent = `${file.name}: ${e.message}`; }
  }
  ev.target.value = "";
  refreshFiles();
});
$("refresh-files").addEventListener("click", refreshFiles);

// -- agent ------------------------------------------------------------------------------------
$("run-agent").addEventListener("click", async () => {
  $("run-agent").disabled = true;
  const log = $("agent-log");
  log.innerHTML = "";
  const add = (kind, text, extra) => log.append(el("div", { className: "ev " + kind + (extra || "") }, el("pre", { textContent: text })));
  try {
    const body = { task: $("task").value, provider: $("provider").value };
    if ($("model").value.trim()) body.model = $("model").value.trim();
    if ($("base-url").value.trim()) body.base_url = $("base-url").value.trim();
    await sse("/v1/agent/runs", body, (kind, data) => {
      if (kind === "assistant") add(kind, "model: " + (data.text || "(asks for tools)"));
      else if (kind === "tool_call") add(kind, `${data.name} ${data.id}\n` + (data.arguments.code || JSON.stringify(data.arguments)));
      else if (kind === "tool_result") add(kind, data.content, data.is_error ? " err" : "");
      else if (kind === "done") add(kind, `answer (${data.stop_reason}, ${data.turns} turns): ${data.answer}`);
      else add("error", `${data.code || "error"}: ${data.message || JSON.stringify(data)}`);
    });
  } catch (e) {
    add("error", e.message);
  } finally {
    $("run-agent").disabled = false;
    refreshUsage();
  }
});

async function refreshUsage() {
  try {
    const u = await api("GET", "/v1/usage");
    $("usage").textContent = `agent today: ${u.agent_runs}/${u.limits.agent_runs_per_day} runs, ` +
      `${u.input_tokens + u.output_tokens} tokens`;
  } catch (e) { $("usage").textContent = ""; }
}

// A page with a token starts as a notebook: the session it had, else the newest of the token's,
// else a new one (values and charts show in a session); one-off runs if none can be had.
async function startNotebook() {
  if (session) return;
  let mine = [];
  try { mine = await api("GET", "/v1/sessions"); } catch (e) { return; }
  if (session) return; // chosen meanwhile (New session, open)
  if (mine.length) {
    mine.sort((a, b) => b.last_used - a.last_used);
    attach(mine[0].id);
    return;
  }
  try {
    const s = await api("POST", "/v1/sessions", {
      ttl_seconds: 3600, quota: "64m", limits: { memory: $("memory").value, runtime: $("runtime").value },
      template: $("template").value || null,
    });
    if (session) { api("DELETE", `/v1/sessions/${s.id}`).catch(() => {}); return; } // one was chosen meanwhile
    attach(s.id);
  } catch (e) {
    $("mode").textContent = `No session (${e.message}): each cell runs once in a fresh sandbox; print what you want to see.`;
  }
}

async function start() {
  if (!$("token").value.trim()) { $("mode").textContent = "Paste a token above (sandloop tokens create NAME) to start."; return; }
  await startNotebook();
  refreshSessions();
  refreshFiles();
  refreshUsage();
}

// -- a terminal inside the session, and previews of its ports ----------------------------------
let term = null; // {xterm, pid, session, abort, pending, sending}

function b64bytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// Keys in the order typed: one input call at a time, what was typed meanwhile sent with the next.
function typeInto(t, data) {
  t.pending += data;
  if (t.sending) return;
  t.sending = true;
  const chunk = t.pending;
  t.pending = "";
  api("POST", `/v1/sessions/${t.session}/terminals/${t.pid}/input`, { data: chunk })
    .catch((e) => { $("terminal-status").textContent = e.message; })
    .finally(() => { t.sending = false; if (t.pending) typeInto(t, ""); });
}

async function openTerminal() {
  if (!session || term) return;
  const xterm = new Terminal({ cols: 100, rows: 24, fontSize: 13, cursorBlink: true, convertEol: false });
  $("terminal").textContent = "";
  xterm.open($("terminal"));
  $("terminal-status").textContent = "starting…";
  let made;
  try {
    made = await api("POST", `/v1/sessions/${session}/terminals`, { cols: xterm.cols, rows: xterm.rows });
  } catch (e) {
    xterm.dispose();
    $("terminal-status").textContent = e.message;
    return;
  }
  term = { xterm, pid: made.pid, session, abort: new AbortController(), pending: "", sending: false };
  const t = term;
  xterm.onData((d) => typeInto(t, d));
  $("terminal-status").textContent = `bash (pid ${t.pid}) in ${session}`;
  $("open-terminal").disabled = true;
  $("close-terminal").disabled = false;
  xterm.focus();
  try {
    const res = await fetch(`/v1/sessions/${t.session}/terminals/${t.pid}/output`, { headers: headers(), signal: t.abort.signal });
    if (!res.ok) throw await failure(res);
    await readEvents(res, (kind, data) => {
      if (kind === "data") xterm.write(b64bytes(data));
      if (kind === "exit") $("terminal-status").textContent = `the shell ended (exit ${data.exit_code})`;
    });
  } catch (e) {
    if (e.name !== "AbortError") $("terminal-status").textContent = e.message;
  }
  if (term === t) closeTerminal(false);
}

function closeTerminal(hangUp) {
  const t = term;
  if (!t) return;
  term = null;
  t.abort.abort();
  if (hangUp) api("DELETE", `/v1/sessions/${t.session}/terminals/${t.pid}`).catch(() => {});
  $("open-terminal").disabled = !session;
  $("close-terminal").disabled = true;
}

function previewPort() {
  const port = parseInt($("preview-port").value, 10);
  if (!session || !(port >= 1 && port <= 65535)) return;
  // The path form: the server redirects it to the preview's own origin, keyed for this sandbox
  // and port only (the token given once here never reaches the sandbox, nor its page this origin).
  const path = `/sandboxes/${session}/ports/${port}/`;
  const url = `${path}?sandloop_token=${encodeURIComponent($("token").value.trim())}`;
  $("port-frame").hidden = false;
  $("port-frame").src = url;
  const own = `${location.protocol}//${port}-${session}.localhost${location.port ? ":" + location.port : ""}/`;
  $("port-link").href = own + `?sandloop_token=${encodeURIComponent($("token").value.trim())}`;
  $("port-link").textContent = own;
}

function showReach() {
  $("open-terminal").disabled = !session || !!term;
  $("open-port").disabled = !session;
  if (term && term.session !== session) closeTerminal(true);
}

$("open-terminal").addEventListener("click", openTerminal);
$("close-terminal").addEventListener("click", () => { closeTerminal(true); $("terminal-status").textContent = "closed"; });
$("open-port").addEventListener("click", previewPort);

fetch("/healthz").then((r) => r.json()).then((h) => { $("health").textContent = "engine: " + (h.status || h.code); });
loadCells();
showSession();
start();
