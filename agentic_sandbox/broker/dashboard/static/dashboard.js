// Dashboard entry point: sign in with a token (→ HttpOnly cookie + CSRF token in memory), then
// the views: instances (+ create dialog, instance view), terminal, recordings, sessions, tasks,
// and the live events panel that keeps them all fresh.
import { clearError, explain, showError } from "/static/alerts.js";
import { api, ApiError, onUnauthorized, setCsrf } from "/static/api.js";
import { CreateDialog, loadOperations } from "/static/create.js";
import { $, debounce, fmtDuration } from "/static/dom.js";
import { EventFeed, EventsPanel, renderFeedStatus } from "/static/events.js";
import { HostsView } from "/static/hosts.js";
import { InstancesView } from "/static/instances.js";
import { LoadoutsView } from "/static/loadouts.js";
import { CastPlayer, parseCast } from "/static/player.js";
import { SessionsRoom } from "/static/sessions.js";
import { TasksView } from "/static/tasks.js";
import { SessionTerminal } from "/static/terminal.js";

let terminal = null;
let player = null;
let feed = null;
let me = null;

const ROLE_RANK = { viewer: 0, operator: 1, admin: 2 };

const app = {
  agents: new Map(),
  canOperate: () => Boolean(me) && ROLE_RANK[me.role] >= ROLE_RANK.operator,
  isAdmin: () => Boolean(me) && me.role === "admin",
  openTerminal,
  openPlayer,
  openCreate: (opts) => create.open(opts),
  refresh: {},
};

const instances = new InstancesView(app);
app.instances = instances;
const sessions = new SessionsRoom(app);
const tasks = new TasksView(app);
const loadouts = new LoadoutsView(app, $("#loadouts-panel"));
const hosts = new HostsView(app, $("#hosts-panel"));
const create = new CreateDialog(app);
const eventsPanel = new EventsPanel();

// Each load shows its own failure (with Retry) in its panel; none of them throws.
app.refresh.instances = debounce(() => instances.load(), 250);
app.refresh.sessions = debounce(() => {
  sessions.load();
  instances.loadSessions();
}, 250);
app.refresh.tasks = debounce(() => tasks.load(), 300);
app.refresh.operations = debounce(() => loadOperations(), 300);
app.refresh.hosts = debounce(() => hosts.load(), 300);

function refreshAll() {
  app.refresh.instances.now();
  app.refresh.sessions.now();
  app.refresh.tasks.now();
  app.refresh.operations.now();
  app.refresh.hosts.now();
  instances.loadSnapshots();
  if (instances.selected) instances.egress.loadEvents(); // events the feed may have missed
}

// ---- live events → views ---------------------------------------------------------------------
function onEvent(ev) {
  eventsPanel.add(ev);
  const family = ev.type.split(".")[0];
  if (family === "instance" || family === "agent" || family === "host") app.refresh.instances();
  if (family === "instance" || family === "host") app.refresh.hosts(); // counts and states
  if (family === "agent" || family === "session") app.refresh.sessions();
  if (family === "task") { tasks.onEvent(ev); app.refresh.tasks(); }
  if (family === "operation") { create.onEvent(ev); app.refresh.operations(); }
  if (family === "egress") {
    instances.egress.onEvent(ev);
    if (ev.type === "egress.rules.changed") app.refresh.instances(); // the policy may have changed
  }
  if (family === "instance" && ev.instance_id && ev.instance_id === instances.selected && /snapshot/.test(ev.type)) {
    instances.loadSnapshots();
  }
  window.sandboxEvents.last = ev.seq;
}

function onGap(payload) {
  eventsPanel.gap(payload);
  refreshAll();
}

function startFeed() {
  if (feed) feed.stop();
  feed = new EventFeed({
    onEvent,
    onGap,
    onStatus: (status, detail) => {
      document.body.dataset.feed = status;
      renderFeedStatus(status, detail);
      // After a reconnect, anything not replayed (lists are snapshots) is reloaded once.
      if (status === "live" && feed && feed.connects > 1) refreshAll();
    },
    onUnauthorized: () => signedOut(),
  });
  window.sandboxEvents = {
    get lastEventId() { return feed.lastEventId; },
    get connects() { return feed.connects; },
    get received() { return feed.received; },
    get gaps() { return feed.gaps; },
    get status() { return feed.status; },
    reconnect: () => feed.reconnect(),
    last: null,
  };
  feed.start();
}

// ---- terminal room ---------------------------------------------------------------------------
function renderTerminalState(t) {
  const role = $("#term-role");
  role.textContent = t.role || "—";
  role.dataset.role = t.role || "";
  $("#term-status").textContent = t.status || "";
  $("#term-status").dataset.status = t.status || "";
  $("#term-members").textContent = t.members.map((m) => `${m.subject} (${m.role})`).join(", ") || "—";
  $("#term-members").dataset.count = String(t.members.length);
  $("#term-message").textContent = t.lastMessage || "";
  $("#term-take").disabled = t.role === "controller" || !app.canOperate();
  $("#term-release").disabled = t.role !== "controller";
  $("#term-recording").disabled = t.exited === null;
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
  const room = $("#terminal-room");
  room.hidden = false;
  $("#term-session").textContent = sessionId;
  terminal = new SessionTerminal($("#terminal"), sessionId, { wantControl, onState: renderTerminalState });
  room.scrollIntoView({ block: "nearest" });
  terminal.term.focus();
}

function closeTerminal() {
  if (terminal) terminal.close();
  terminal = null;
  $("#terminal-room").hidden = true;
  app.refresh.sessions();
}

$("#term-take").addEventListener("click", () => terminal && terminal.takeControl());
$("#term-release").addEventListener("click", () => terminal && terminal.releaseControl());
$("#term-reconnect").addEventListener("click", () => terminal && terminal.reconnect());
$("#term-detach").addEventListener("click", closeTerminal);
$("#term-recording").addEventListener("click", () => terminal && openPlayer(terminal.sessionId, $("#term-session").textContent));

// ---- recording player ------------------------------------------------------------------------
function renderPlayerState(p) {
  const playBtn = $("#player-play");
  playBtn.textContent = p.state === "playing" ? "Pause" : p.state === "ended" ? "Replay" : "Play";
  playBtn.setAttribute("aria-pressed", String(p.state === "playing"));
  $("#player-state").textContent = p.state;
  $("#player-state").dataset.state = p.state;
  const seek = $("#player-seek");
  seek.max = String(Math.max(0.01, p.duration));
  if (document.activeElement !== seek || p.state !== "playing") seek.value = String(p.position);
  seek.setAttribute("aria-valuetext", `${fmtDuration(p.position)} of ${fmtDuration(p.duration)}`);
  $("#player-time").textContent = `${fmtDuration(p.position)} / ${fmtDuration(p.duration)}`;
  $("#player-message").textContent = p.lastMarker ? `marker: ${p.lastMarker}` : "";
  window.sandboxPlayer = { state: p.state, position: p.position, duration: p.duration, speed: p.speed, events: p.cast.events.length };
}

async function openPlayer(sessionId, label) {
  if (player) { player.dispose(); player = null; }
  const room = $("#player-room");
  room.hidden = false;
  $("#player-session").textContent = label || sessionId;
  $("#player-session").title = sessionId;
  $("#player-terminal").replaceChildren();
  $("#player-error").textContent = "";
  $("#player-message").textContent = "";
  $("#player-download").href = `/api/v2/admin/sessions/${encodeURIComponent(sessionId)}/recording`;
  $("#player-download").setAttribute("download", `${sessionId}.cast`);
  window.sandboxPlayer = { state: "loading" };
  for (const id of ["#player-play", "#player-restart", "#player-seek"]) $(id).disabled = true;
  room.scrollIntoView({ block: "nearest" });
  let cast;
  try {
    cast = parseCast(await api(`/api/v2/admin/sessions/${encodeURIComponent(sessionId)}/recording`, { accept: "text" }));
  } catch (err) {
    showError($("#player-error"), err, { what: "Cannot play this recording", retry: () => openPlayer(sessionId, label) });
    window.sandboxPlayer = { state: "error", error: err.message };
    return;
  }
  player = new CastPlayer($("#player-terminal"), cast, { onState: renderPlayerState });
  player.setSpeed(Number($("#player-speed").value));
  for (const id of ["#player-play", "#player-restart", "#player-seek"]) $(id).disabled = false;
  if (cast.skipped) $("#player-error").textContent = `${cast.skipped} unreadable line(s) skipped.`;
  player.play();
  $("#player-play").focus();
}

$("#player-play").addEventListener("click", () => player && player.toggle());
$("#player-restart").addEventListener("click", () => { if (player) { player.seek(0); player.play(); } });
$("#player-speed").addEventListener("change", () => player && player.setSpeed(Number($("#player-speed").value)));
$("#player-seek").addEventListener("input", () => player && player.seek(Number($("#player-seek").value)));
$("#player-close").addEventListener("click", () => {
  if (player) player.dispose();
  player = null;
  $("#player-room").hidden = true;
});
$("#player-room").addEventListener("keydown", (ev) => {
  // Space toggles playback, arrows seek 5 s (when focus is not in a form control).
  if (!player || ["INPUT", "SELECT", "BUTTON", "A"].includes(ev.target.tagName)) return;
  if (ev.key === " ") { ev.preventDefault(); player.toggle(); }
  if (ev.key === "ArrowRight") player.seek(player.position + 5);
  if (ev.key === "ArrowLeft") player.seek(player.position - 5);
});

// ---- login / logout --------------------------------------------------------------------------
async function showApp() {
  me = await api("/api/v2/admin/whoami", { quiet401: true });
  setCsrf(me.csrf_token);
  $("#who").textContent = `${me.subject} (${me.role})`;
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#nav").hidden = false;
  $("#logout").hidden = false;
  document.body.dataset.role = me.role;
  $("#create-open").disabled = !app.canOperate();
  $("#new-session button[type=submit]").disabled = !app.canOperate();
  startFeed();
  await Promise.all([instances.load(), sessions.load(), tasks.load(), loadouts.load(), hosts.load(), loadOperations()]);
  document.body.dataset.loaded = "app"; // every request of the load answered (tests wait on it)
}

/** Back to the sign-in form, with `message` saying why. Nothing of the session stays open
 * over it: the feed and terminal end, open dialogs close, the player stops. */
function signedOut(message = "Your session has expired or was revoked: sign in again.") {
  if (feed) feed.stop();
  feed = null;
  if (terminal) terminal.close();
  terminal = null;
  if (player) player.dispose();
  player = null;
  for (const dialog of document.querySelectorAll("dialog[open]")) dialog.close();
  $("#terminal-room").hidden = true;
  $("#player-room").hidden = true;
  me = null;
  setCsrf(null);
  $("#app").hidden = true;
  $("#nav").hidden = true;
  $("#logout").hidden = true;
  $("#who").textContent = "";
  $("#login").hidden = false;
  clearError($("#login-error"));
  $("#login-error").textContent = message;
  $("#token").focus();
  document.body.dataset.loaded = "login";
}

onUnauthorized((err) => { if (me) signedOut(explain(err)); });

/** Open the app for a signed-in browser; if the server cannot say who we are (down, no
 * network, a 5xx), say so on the sign-in form with a Retry, instead of a blank page. */
async function resume() {
  try {
    await showApp();
  } catch (err) {
    $("#app").hidden = true;
    $("#login").hidden = false;
    if (err instanceof ApiError && err.kind === "unauthorized") {
      signedOut(); // the session ended meanwhile
    } else {
      showError($("#login-error"), err, { what: "Could not open the dashboard", retry: resume, always: true });
      document.body.dataset.loaded = "login";
    }
  }
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  clearError($("#login-error"));
  const field = $("#token");
  try {
    await api("/api/v2/admin/login", { method: "POST", body: { token: field.value.trim() }, quiet401: true });
    field.value = ""; // the token is not kept anywhere; the HttpOnly cookie carries the session
    await showApp();
  } catch (err) {
    // a wrong token is the server's 401 "the token is invalid, expired or revoked"
    if (err instanceof ApiError && err.kind === "unauthorized") $("#login-error").textContent = `Sign-in failed: ${err.detail}`;
    else showError($("#login-error"), err, { what: "Sign-in failed" });
  }
});

$("#logout").addEventListener("click", async () => {
  try { await api("/api/v2/admin/logout", { method: "POST" }); } catch (_) { /* signed out anyway */ }
  signedOut("Signed out.");
});

// The server says in the page whether this browser's session cookie is valid: a page that is
// not signed in shows the form without asking (an anonymous whoami on every load would be a
// refusal the server audits and shows in the events panel).
if (document.querySelector('meta[name="sandbox-session"]')?.content === "signed-in") {
  resume();
} else {
  $("#token").focus();
  document.body.dataset.loaded = "login";
}
