// Dashboard entry point: login with a token, then the views.
import { SessionTerminal } from "/static/terminal.js";

const $ = (sel) => document.querySelector(sel);
let csrf = null;
let terminal = null;

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (csrf && options.method && options.method !== "GET") headers["X-CSRF-Token"] = csrf;
  const resp = await fetch(path, Object.assign({}, options, { headers, credentials: "same-origin" }));
  if (!resp.ok) {
    let detail = resp.statusText;
    try { detail = (await resp.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(detail);
  }
  return resp.status === 204 ? null : resp.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// ---- sessions room ---------------------------------------------------------------------------
async function loadSessions() {
  const [sessions, agents] = await Promise.all([
    api("/api/v2/admin/sessions?limit=100"),
    api("/api/v2/admin/agents"),
  ]);
  const body = $("#sessions tbody");
  body.replaceChildren();
  for (const s of sessions.items) {
    const live = s.held && !["exited", "failed", "lost"].includes(s.state);
    const actions = el("td", {});
    if (s.held) {
      actions.append(
        el("button", { type: "button", class: "attach-control", dataset: { session: s.id }, onclick: () => openTerminal(s.id, true) }, "Attach as controller"),
        el("button", { type: "button", class: "attach-observe", dataset: { session: s.id }, onclick: () => openTerminal(s.id, false) }, "Observe"),
      );
    }
    if (live) {
      actions.append(el("button", { type: "button", class: "kill", onclick: () => killSession(s.id) }, "Kill"));
    }
    body.append(el("tr", { dataset: { session: s.id } },
      el("td", { title: s.id }, el("code", {}, s.id.slice(0, 8))),
      el("td", {}, s.instance_id),
      el("td", {}, s.name || (s.command ? s.command.join(" ") : "login shell")),
      el("td", { class: `state state-${s.state}` }, s.state + (s.exit_code !== null ? ` (${s.exit_code})` : "")),
      el("td", {}, s.controller || "—"),
      el("td", {}, String(s.observers)),
      actions,
    ));
  }
  const select = $("#new-instance");
  const current = select.value;
  select.replaceChildren();
  for (const a of agents.items.filter((x) => x.state === "connected")) {
    select.append(el("option", { value: a.instance_id }, a.instance_id));
  }
  if (current) select.value = current;
}

async function killSession(id) {
  try {
    await api(`/api/v2/admin/sessions/${encodeURIComponent(id)}/kill`, { method: "POST", body: "{}" });
  } catch (err) {
    $("#new-error").textContent = `kill failed: ${err.message}`;
  }
  setTimeout(loadSessions, 500);
}

$("#new-session").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("#new-error").textContent = "";
  const instance = $("#new-instance").value;
  if (!instance) { $("#new-error").textContent = "no connected agent"; return; }
  const body = { instance_id: instance, cols: 100, rows: 30 };
  const command = $("#new-command").value.trim();
  if (command) body.command = ["/bin/sh", "-c", command];
  try {
    const created = await api("/api/v2/admin/sessions", { method: "POST", body: JSON.stringify(body) });
    await loadSessions();
    openTerminal(created.id, true);
  } catch (err) {
    $("#new-error").textContent = `could not create: ${err.message}`;
  }
});

$("#sessions-refresh").addEventListener("click", () => loadSessions().catch(() => {}));

// ---- terminal room ---------------------------------------------------------------------------
function renderTerminalState(t) {
  const role = $("#term-role");
  role.textContent = t.role || "—";
  role.dataset.role = t.role || "";
  $("#term-status").textContent = t.status || "";
  $("#term-status").dataset.status = t.status || "";
  $("#term-members").textContent = t.members.map((m) => `${m.subject} (${m.role})`).join(", ");
  $("#term-members").dataset.count = String(t.members.length);
  $("#term-message").textContent = t.lastMessage || "";
  $("#term-take").disabled = t.role === "controller";
  $("#term-release").disabled = t.role !== "controller";
  window.sandboxTerminal = {
    session: t.sessionId,
    role: t.role,
    nextOffset: t.nextOffset,
    reconnects: t.reconnects,
    lastHelloFrom: t.lastHello ? t.lastHello.from : null,
    members: t.members.length,
    exited: t.exited,
  };
}

function openTerminal(sessionId, wantControl) {
  if (terminal) terminal.close();
  $("#terminal").replaceChildren();
  $("#terminal-room").hidden = false;
  $("#term-session").textContent = sessionId;
  terminal = new SessionTerminal($("#terminal"), sessionId, { wantControl, onState: renderTerminalState });
  terminal.term.focus();
}

$("#term-take").addEventListener("click", () => terminal && terminal.takeControl());
$("#term-release").addEventListener("click", () => terminal && terminal.releaseControl());
$("#term-reconnect").addEventListener("click", () => terminal && terminal.reconnect());
$("#term-detach").addEventListener("click", () => {
  if (terminal) terminal.close();
  terminal = null;
  $("#terminal-room").hidden = true;
  loadSessions().catch(() => {});
});

// ---- login -----------------------------------------------------------------------------------
async function showApp() {
  const me = await api("/api/v2/admin/whoami");
  csrf = me.csrf_token;
  $("#who").textContent = `${me.subject} (${me.role})`;
  $("#login").hidden = true;
  $("#app").hidden = false;
  await loadSessions();
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("#login-error").textContent = "";
  try {
    await api("/api/v2/admin/login", { method: "POST", body: JSON.stringify({ token: $("#token").value.trim() }) });
    await showApp();
  } catch (err) {
    $("#login-error").textContent = `Sign-in failed: ${err.message}`;
  }
});

showApp().catch(() => { /* not signed in yet */ });
