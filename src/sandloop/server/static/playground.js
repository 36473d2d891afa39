"use strict";
// The playground over the HTTP API. A separate file: the page's CSP allows scripts from this origin only.
const $ = (id) => document.getElementById(id);
$("token").value = localStorage.getItem("sandloop-token") || "";
$("token").addEventListener("change", () => localStorage.setItem("sandloop-token", $("token").value.trim()));
let session = null;

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: { "Authorization": "Bearer " + $("token").value.trim(), "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = { message: text }; }
  if (!res.ok) throw new Error(`${res.status} ${data && data.code ? data.code + ": " : ""}${data && data.message ? data.message : ""}`);
  return data;
}

function showNotes(el, notes) {
  el.innerHTML = "";
  for (const n of notes || []) { const d = document.createElement("div"); d.className = "note"; d.textContent = "⚠ " + n; el.appendChild(d); }
}

async function run() {
  $("run").disabled = true; $("status").textContent = "running…"; $("status").className = "status muted";
  try {
    const r = await api("POST", "/v1/runs", { code: $("code").value, language: $("language").value, timeout_seconds: Number($("timeout").value) });
    $("stdout").textContent = r.stdout; $("stderr").textContent = r.stderr;
    $("status").textContent = r.timed_out ? "timed out" : `exit ${r.exit_code}`;
    $("status").className = "status " + (r.ok ? "ok" : "bad");
    $("duration").textContent = `${(r.duration_seconds * 1000).toFixed(0)} ms`;
    showNotes($("notes"), r.notes);
  } catch (e) {
    $("status").textContent = e.message; $("status").className = "status bad";
  } finally { $("run").disabled = false; }
}

async function refreshFiles() {
  const tbody = $("files").querySelector("tbody"); tbody.innerHTML = "";
  if (!session) return;
  for (const f of await api("GET", `/v1/sessions/${session}/files`)) {
    const tr = document.createElement("tr");
    for (const v of [f.type, f.size, f.name]) { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); }
    tbody.appendChild(tr);
  }
}

async function newSession() {
  $("new-session").disabled = true;
  try {
    const s = await api("POST", "/v1/sessions", { ttl_seconds: 3600, quota: "64m" });
    session = s.id; $("session-id").textContent = session;
    $("run-cell").disabled = false; $("delete-session").disabled = false;
    await refreshFiles();
  } catch (e) { $("session-id").textContent = e.message; }
  finally { $("new-session").disabled = false; }
}

async function runCell() {
  $("run-cell").disabled = true; $("cell-status").textContent = "running…"; $("cell-status").className = "status muted";
  try {
    const r = await api("POST", `/v1/sessions/${session}/cells`, { code: $("cell").value, timeout_seconds: 30 });
    $("cell-value").textContent = r.value === null ? "" : r.value;
    $("cell-output").textContent = r.stdout + r.stderr;
    $("cell-status").textContent = r.timed_out ? "timed out" : `exit ${r.exit_code}`;
    $("cell-status").className = "status " + (r.ok ? "ok" : "bad");
    showNotes($("cell-notes"), r.notes.concat(r.interpreter_restarted ? ["the interpreter was restarted: variables are gone"] : []));
    $("charts").innerHTML = "";
    for (const a of r.artifacts) {
      const img = document.createElement("img"); img.alt = a.name; img.src = `data:${a.mime_type};base64,${a.data_base64}`;
      $("charts").appendChild(img);
    }
    await refreshFiles();
  } catch (e) { $("cell-status").textContent = e.message; $("cell-status").className = "status bad"; }
  finally { $("run-cell").disabled = false; }
}

async function deleteSession() {
  if (!session) return;
  await api("DELETE", `/v1/sessions/${session}`);
  session = null; $("session-id").textContent = "none"; $("run-cell").disabled = true; $("delete-session").disabled = true;
  $("charts").innerHTML = ""; await refreshFiles();
}

async function runAgent() {
  $("run-agent").disabled = true; const log = $("agent-log"); log.innerHTML = "";
  const add = (kind, text, extra) => {
    const d = document.createElement("div"); d.className = "ev " + kind + (extra || "");
    const pre = document.createElement("pre"); pre.textContent = text; d.appendChild(pre); log.appendChild(d);
  };
  try {
    const res = await fetch("/v1/agent/runs", {
      method: "POST",
      headers: { "Authorization": "Bearer " + $("token").value.trim(), "Content-Type": "application/json" },
      body: JSON.stringify({ task: $("task").value, provider: $("provider").value, model: $("model").value,
                             base_url: $("base-url").value.trim() || null }),
    });
    if (!res.ok) { const e = await res.json(); add("error", `${res.status} ${e.code}: ${e.message}`); return; }
    const reader = res.body.getReader(); const dec = new TextDecoder(); let buf = "";
    for (;;) {
      const { value, done } = await reader.read(); if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i); buf = buf.slice(i + 2);
        const kind = (block.match(/^event: (.*)$/m) || [])[1]; const data = JSON.parse((block.match(/^data: (.*)$/m) || [])[1] || "{}");
        if (kind === "assistant") add(kind, "model: " + (data.text || "(asks for tools)"));
        else if (kind === "tool_call") add(kind, `${data.name} ${data.id}\n` + (data.arguments.code || JSON.stringify(data.arguments)));
        else if (kind === "tool_result") add(kind, data.content, data.is_error ? " err" : "");
        else if (kind === "done") add(kind, `answer (${data.stop_reason}, ${data.turns} turns): ${data.answer}`);
        else add("error", data.message || JSON.stringify(data));
      }
    }
  } catch (e) { add("error", e.message); }
  finally { $("run-agent").disabled = false; }
}

$("run").addEventListener("click", run);
$("run-agent").addEventListener("click", runAgent);
$("code").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(); });
$("new-session").addEventListener("click", newSession);
$("run-cell").addEventListener("click", runCell);
$("delete-session").addEventListener("click", deleteSession);
fetch("/healthz").then(r => r.json()).then(h => { $("health").textContent = "engine: " + (h.status || h.code); });
