// The kernelhub review page. Vanilla JS, no build step. It uses the same REST and
// WebSocket API as every client; the sign-in cookie authenticates, and every request
// that changes something carries X-CSRF-Token. Untrusted strings (code, output, names)
// only ever reach the DOM through textContent/attributes; HTML output goes into
// sandbox="" iframes with a CSP of their own, so it can never run script here.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { me: null, csrf: null, view: null };
const IFRAME_CSP =
  "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; " +
  "img-src data:; style-src 'unsafe-inline'\">";
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function cookie(name) {
  for (const part of document.cookie.split(";")) {
    const [k, v] = part.trim().split("=");
    if (k === name) return decodeURIComponent(v || "");
  }
  return null;
}

function flash(message) {
  const box = $("flash");
  box.textContent = message || "";
  box.hidden = !message;
}

async function api(method, path, body) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET") headers["X-CSRF-Token"] = state.csrf || cookie("kh_csrf") || "";
  const r = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 204) return null;
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = new Error(data.message || `${method} ${path}: HTTP ${r.status}`);
    err.status = r.status;
    throw err;
  }
  return data;
}

async function act(fn) {
  try { flash(""); return await fn(); } catch (e) { flash(e.message); return undefined; }
}

function show(section) {
  for (const id of ["signin", "sessions", "session", "audit"]) $(id).hidden = id !== section;
}

// -- sign-in -----------------------------------------------------------------------

async function whoami() {
  try { state.me = await api("GET", "/v1/whoami"); } catch (e) { state.me = null; }
  const me = state.me;
  $("nav").hidden = !me;
  if (!me) return false;
  const scope = [me.admin ? "admin" : "", me.read_only ? "read-only" : "",
    me.session_id ? `session ${me.session_id}` : ""].filter(Boolean).join(", ");
  $("whoami").textContent = (me.token || me.name) + (scope ? ` (${scope})` : "");
  $("nav-audit").hidden = !me.admin;
  $("stop-all").hidden = !me.admin;
  document.body.classList.toggle("read-only", !!me.read_only);
  return true;
}

$("signin-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  act(async () => {
    const signed = await api("POST", "/v1/auth/session", { token: $("token").value });
    $("token").value = "";
    state.csrf = signed.csrf_token;
    await whoami();
    route();
  });
});

$("signout").addEventListener("click", () => act(async () => {
  await api("DELETE", "/v1/auth/session");
  state.me = null; state.csrf = null;
  closeView();
  $("nav").hidden = true;
  location.hash = "#/";
  show("signin");
}));

$("stop-all").addEventListener("click", () => act(async () => {
  if (!confirm("Stop and delete EVERY session of every user?")) return;
  const r = await api("POST", "/v1/admin/stop-all");
  await loadSessions();
  flash(`stopped ${r.stopped} session(s)`);
}));

// -- sessions list -------------------------------------------------------------------

function age(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function limitsText(l) {
  const mib = (b) => (b == null ? "-" : `${Math.round(b / 1048576)} MiB`);
  return `mem ${mib(l.memory_bytes)}, cpus ${l.cpus ?? "-"}, cell ${l.cell_timeout ?? "-"} s`;
}

async function loadSessions() {
  const me = state.me;
  if (!me) return;
  const path = me.admin ? "/v1/admin/sessions" : "/v1/sessions";
  let list;
  try { list = await api("GET", path); } catch (e) { flash(e.message); return; }
  // (No flash("") here: it polls, and must not wipe what an action just reported.)
  const want = $("f-state").value, owner = $("f-owner").value.trim().toLowerCase();
  const text = $("f-text").value.trim().toLowerCase();
  const body = $("session-table").tBodies[0];
  body.replaceChildren();
  for (const s of list.sessions) {
    if (want === "waiting" ? !s.awaiting_input : want && s.state !== want) continue;
    if (owner && !s.owner.toLowerCase().includes(owner)) continue;
    if (text && !(s.id + JSON.stringify(s.metadata)).toLowerCase().includes(text)) continue;
    const link = el("a", { href: `#/session/${encodeURIComponent(s.id)}`, text: s.id });
    const row = el("tr", { "data-session": s.id, class: s.awaiting_input ? "waiting" : "" },
      el("td", {}, link), el("td", { text: s.owner }),
      el("td", {}, el("span", { class: "state", text: s.state })),
      el("td", { text: age(s.created_at) }), el("td", { text: limitsText(s.limits || {}) }),
      el("td", { class: "usage", text: `${s.last_seq} events, ${(s.stored_bytes / 1024).toFixed(1)} KiB stored` }),
      el("td", { class: "gate-flag", text: s.awaiting_input ? "waiting for an answer" : "" }));
    body.append(row);
  }
}

for (const id of ["f-state", "f-owner", "f-text"]) $(id).addEventListener("input", loadSessions);
$("refresh").addEventListener("click", loadSessions);

// -- live view of one session ---------------------------------------------------------

function closeView() {
  const v = state.view;
  state.view = null;
  if (v) { v.closed = true; clearInterval(v.poll); if (v.ws) v.ws.close(); }
}

function openView(id) {
  closeView();
  const v = { id, lastSeq: 0, cells: new Map(), displays: new Map(), running: null,
    ws: null, closed: false, poll: null };
  state.view = v;
  $("s-id").textContent = id;
  $("cells").replaceChildren();
  $("gates").replaceChildren();
  const base = `/v1/sessions/${encodeURIComponent(id)}/notebook`;
  $("c-ipynb").href = `${base}?format=ipynb`;
  $("c-html").href = `${base}?format=html`;
  for (const b of document.querySelectorAll(".controls button")) b.disabled = !!state.me.read_only;
  refreshInfo(v);
  v.poll = setInterval(() => refreshInfo(v), 2000);
  connect(v);
}

async function refreshInfo(v) {
  try {
    const info = await api("GET", `/v1/sessions/${encodeURIComponent(v.id)}`);
    if (state.view === v) $("s-state").textContent = info.state;
  } catch (e) {
    if (state.view === v) $("s-state").textContent = e.status === 410 ? "ended" : "?";
  }
}

function connect(v) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const url = `${scheme}://${location.host}/v1/sessions/${encodeURIComponent(v.id)}/stream?since=${v.lastSeq}`;
  const ws = new WebSocket(url);
  v.ws = ws;
  $("s-conn").textContent = "connecting";
  ws.onopen = () => { $("s-conn").textContent = "live"; };
  ws.onmessage = (m) => {
    let frame;
    try { frame = JSON.parse(m.data); } catch (e) { return; }
    if (frame.type === "event") apply(v, frame.event);
    else if (frame.type === "error") flash(frame.message);
  };
  ws.onclose = (ev) => {
    if (v.closed || state.view !== v) return;
    if ([4401, 4404, 4410].includes(ev.code)) {
      $("s-conn").textContent = ev.reason || `closed (${ev.code})`;
      return;
    }
    // Gap-free: the stream replays every event after the last one we applied.
    $("s-conn").textContent = "reconnecting";
    setTimeout(() => { if (!v.closed) connect(v); }, 1000);
  };
}

function cellOf(v, executionId) {
  let cell = v.cells.get(executionId);
  if (cell) return cell;
  const node = el("div", { class: "cell", "data-execution": executionId });
  const status = el("span", { class: "status", text: "queued" });
  const timing = el("span", { class: "timing" });
  const who = el("span", { class: "who" });
  const code = el("pre", { class: "code" });
  const outputs = el("div", { class: "outputs" });
  node.append(el("div", { class: "meta" }, el("code", { text: executionId }), status, timing, who),
    code, outputs);
  $("cells").append(node);
  cell = { node, status, timing, who, code, outputs, clearNext: false };
  v.cells.set(executionId, cell);
  api("GET", `/v1/executions/${encodeURIComponent(executionId)}?events=false`)
    .then((info) => { code.textContent = info.code; })
    .catch(() => { code.textContent = "(code unavailable)"; });
  return cell;
}

function addOutput(cell, node) {
  if (cell.clearNext) { cell.outputs.replaceChildren(); cell.clearNext = false; }
  cell.outputs.append(node);
}

function htmlFrame(html) {
  // sandbox="" : no scripts, no forms, no same-origin; and a CSP that allows no fetches.
  const frame = el("iframe", { sandbox: "", referrerpolicy: "no-referrer", class: "html-output" });
  frame.srcdoc = IFRAME_CSP + html;
  return frame;
}

function bundle(data) {
  for (const mime of ["image/png", "image/jpeg"]) {
    const b64 = typeof data[mime] === "string" ? data[mime].replace(/\s+/g, "") : null;
    if (b64 !== null && BASE64.test(b64)) {
      return el("img", { src: `data:${mime};base64,${b64}`, alt: "plot", class: "image-output" });
    }
  }
  if (typeof data["text/html"] === "string") return htmlFrame(data["text/html"]);
  const text = data["text/plain"];
  return el("pre", { class: "text-output", text: typeof text === "string" ? text : JSON.stringify(data) });
}

function apply(v, ev) {
  if (ev.seq && ev.seq <= v.lastSeq) return; // replayed twice across a reconnect
  if (ev.seq) v.lastSeq = ev.seq;
  if (!ev.execution_id) { // about the session, between cells (a restart, a rewind)
    if (ev.type === "notice") $("cells").append(el("pre", { class: "notice", text: ev.message }));
    return;
  }
  const cell = cellOf(v, ev.execution_id);
  switch (ev.type) {
    case "stream": {
      const last = cell.outputs.lastElementChild;
      if (!cell.clearNext && last && last.dataset.stream === ev.name) last.textContent += ev.text;
      else addOutput(cell, el("pre", { class: ev.name, "data-stream": ev.name, text: ev.text }));
      break;
    }
    case "display": {
      const node = bundle(ev.data || {});
      const old = ev.display_id ? v.displays.get(ev.display_id) : null;
      if (ev.update && old) { old.replaceWith(node); } else if (!ev.update) { addOutput(cell, node); }
      if (ev.display_id) v.displays.set(ev.display_id, node);
      break;
    }
    case "result": addOutput(cell, bundle(ev.data || {})); break;
    case "error": {
      const e = ev.error || {};
      const text = (e.traceback && e.traceback.length ? e.traceback.join("\n") : "") || `${e.name}: ${e.value}`;
      addOutput(cell, el("pre", { class: "traceback", text }));
      break;
    }
    case "clear_output":
      if (ev.wait) cell.clearNext = true; else cell.outputs.replaceChildren();
      break;
    case "input_request": showGate(v, ev); cell.status.textContent = "awaiting_input"; break;
    case "input_reply": {
      dropGate(ev.execution_id);
      const shown = ev.password ? "(hidden)" : ev.value;
      addOutput(cell, el("pre", { class: "answer", text: `answered ${JSON.stringify(shown)} by ${ev.answered_by}` }));
      break;
    }
    case "status":
      cell.status.textContent = ev.status;
      cell.status.className = `status status-${ev.status}`;
      if (ev.status === "running" || ev.status === "awaiting_input") v.running = ev.execution_id;
      break;
    case "notice": case "truncated":
      addOutput(cell, el("pre", { class: "notice", text: ev.message || `output truncated at ${ev.limit_bytes} bytes` }));
      break;
    case "final": {
      const r = ev.record;
      dropGate(ev.execution_id);
      cell.status.textContent = r.status;
      cell.status.className = `status status-${r.status}`;
      const parts = [`${r.duration.toFixed(3)} s`];
      if (r.cpu_seconds != null) parts.push(`cpu ${r.cpu_seconds.toFixed(2)} s`);
      if (r.peak_memory_bytes != null) parts.push(`peak ${Math.round(r.peak_memory_bytes / 1048576)} MiB`);
      cell.timing.textContent = parts.join(", ");
      if (r.reason) cell.who.textContent = r.reason;
      if (v.running === ev.execution_id) v.running = null;
      break;
    }
    default: break;
  }
}

function showGate(v, ev) {
  dropGate(ev.execution_id);
  const readOnly = !!state.me.read_only;
  const isConfirm = /\[y\/N\]\s*$/.test(ev.prompt);
  const box = el("div", { class: "gate", "data-execution": ev.execution_id },
    el("div", { class: "prompt", text: isConfirm ? ev.prompt.replace(/\s*\[y\/N\]\s*$/, "") : ev.prompt }));
  const send = (value) => act(() => api("POST",
    `/v1/executions/${encodeURIComponent(ev.execution_id)}/input`, { value }));
  if (isConfirm) {
    const yes = el("button", { class: "approve", text: "Approve" });
    const no = el("button", { class: "deny danger", text: "Deny" });
    yes.onclick = () => send("y");
    no.onclick = () => send("n");
    yes.disabled = no.disabled = readOnly;
    box.append(el("div", { class: "buttons" }, yes, no));
  } else {
    const input = el("input", { class: "answer-input", type: ev.password ? "password" : "text", autocomplete: "off" });
    const ok = el("button", { class: "answer", type: "submit", text: "Answer" });
    const form = el("form", {}, input, ok);
    form.onsubmit = (e) => { e.preventDefault(); send(input.value); };
    input.disabled = ok.disabled = readOnly;
    box.append(form);
  }
  $("gates").append(box);
  box.scrollIntoView({ block: "nearest" });
}

function dropGate(executionId) {
  for (const g of $("gates").querySelectorAll(".gate")) {
    if (g.dataset.execution === executionId) g.remove();
  }
}

for (const b of document.querySelectorAll(".controls button")) {
  b.addEventListener("click", () => act(async () => {
    const v = state.view;
    if (!v) return;
    const sid = encodeURIComponent(v.id);
    const what = b.dataset.act;
    if (what === "interrupt") {
      if (!v.running) { flash("no cell is running"); return; }
      await api("POST", `/v1/executions/${encodeURIComponent(v.running)}/interrupt`);
    } else if (what === "delete") {
      if (!confirm(`Delete session ${v.id}? Its sandbox and variables are lost.`)) return;
      await api("DELETE", `/v1/sessions/${sid}`);
      location.hash = "#/sessions";
    } else if (what === "restart") {
      if (!confirm(`Restart the kernel of ${v.id}? Its variables are lost (files stay).`)) return;
      await api("POST", `/v1/sessions/${sid}/restart`);
    } else {
      await api("POST", `/v1/sessions/${sid}/${what}`);
    }
    refreshInfo(v);
  }));
}

// -- audit log ------------------------------------------------------------------------

let auditBefore = null;

async function loadAudit(more) {
  const q = new URLSearchParams({ limit: "100" });
  for (const [key, id] of [["principal", "a-principal"], ["action", "a-action"],
    ["session_id", "a-session"], ["text", "a-text"]]) {
    const value = $(id).value.trim();
    if (value) q.set(key, value);
  }
  if (more && auditBefore != null) q.set("before", String(auditBefore));
  const page = await act(() => api("GET", `/v1/admin/audit?${q}`));
  if (!page) return;
  const body = $("audit-table").tBodies[0];
  if (!more) body.replaceChildren();
  for (const a of page.entries) {
    const res = [a.duration != null ? `${a.duration.toFixed(3)} s` : "",
      a.cpu_seconds != null ? `cpu ${a.cpu_seconds.toFixed(2)} s` : "",
      a.peak_memory_bytes != null ? `${Math.round(a.peak_memory_bytes / 1048576)} MiB` : "",
      a.output_bytes != null ? `out ${a.output_bytes} B` : ""].filter(Boolean).join(", ");
    body.append(el("tr", {}, el("td", { text: a.at }), el("td", { text: a.principal || "" }),
      el("td", { text: a.action }), el("td", { text: a.session_id || "" }),
      el("td", {}, el("pre", { text: (a.code || "").slice(0, 300) })),
      el("td", { text: a.status || (a.detail || "") }), el("td", { text: res })));
  }
  auditBefore = page.next_before;
  $("a-more").hidden = page.next_before == null;
}

$("a-search").addEventListener("click", () => loadAudit(false));
$("a-more").addEventListener("click", () => loadAudit(true));

// -- routing ----------------------------------------------------------------------------

let listTimer = null;

function route() {
  clearInterval(listTimer);
  if (!state.me) { closeView(); show("signin"); return; }
  const hash = location.hash || "#/sessions";
  const m = hash.match(/^#\/session\/(.+)$/);
  if (m) {
    const id = decodeURIComponent(m[1]);
    if (!state.view || state.view.id !== id) openView(id);
    show("session");
  } else if (hash === "#/audit" && state.me.admin) {
    closeView(); show("audit"); loadAudit(false);
  } else {
    closeView(); show("sessions"); loadSessions();
    listTimer = setInterval(loadSessions, 3000); // keeps the human-gate flags fresh
  }
}

window.addEventListener("hashchange", route);
whoami().then(route);
