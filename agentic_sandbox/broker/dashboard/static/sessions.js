// Sessions: the all-sessions table, and the row renderer the instance view reuses.

import { explain, load } from "/static/alerts.js";
import { api, enc } from "/static/api.js";
import { $, badge, el, fillBody, shortId, ago } from "/static/dom.js";

const ENDED = ["exited", "failed", "lost"];

function describeCommand(s) {
  if (s.name) return s.name;
  if (!s.command) return "login shell";
  const [argv0, flag, script] = s.command;
  if (s.command.length === 3 && /(^|\/)(ba)?sh$/.test(argv0) && flag === "-c") return script;
  return s.command.join(" ");
}

/** Action buttons of one session (attach, observe, recording, kill). */
export function sessionActions(app, s, message) {
  const live = s.held && !ENDED.includes(s.state);
  const label = describeCommand(s);
  const cell = el("td", { class: "actions" });
  if (s.held) {
    if (app.canOperate()) {
      cell.append(el("button", { type: "button", class: "attach-control", dataset: { session: s.id },
        "aria-label": `Attach to ${label} as controller`, onclick: () => app.openTerminal(s.id, true) }, "Attach"));
    }
    cell.append(
      el("button", { type: "button", class: "attach-observe", dataset: { session: s.id },
        "aria-label": `Observe ${label}`, onclick: () => app.openTerminal(s.id, false) }, "Observe"),
    );
  }
  if (s.recording) {
    cell.append(el("button", { type: "button", class: "play-recording", dataset: { session: s.id },
      "aria-label": `Play the recording of ${label}`, onclick: () => app.openPlayer(s.id, label) }, "Recording"));
  }
  if (live && app.canOperate()) {
    cell.append(el("button", { type: "button", class: "kill danger-text", "aria-label": `Kill ${label}`,
      onclick: () => killSession(app, s.id, message) }, "Kill"));
  }
  return cell;
}

export function sessionRow(app, s, { withInstance = true, message } = {}) {
  const state = s.state + (s.exit_code !== null && s.exit_code !== undefined ? ` (${s.exit_code})` : "");
  return el("tr", { dataset: { session: s.id, state: s.state } },
    el("td", { title: s.id }, el("code", {}, shortId(s.id))),
    withInstance ? el("td", {}, s.instance_id) : null,
    el("td", { class: "wrap" }, describeCommand(s),
      s.task_id && !describeCommand(s).includes(shortId(s.task_id)) ? el("span", { class: "muted" }, ` · task ${shortId(s.task_id)}`) : null),
    el("td", { class: "state" }, badge(s.state, state)),
    el("td", {}, s.controller || "—"),
    el("td", {}, String(s.observers)),
    el("td", { class: "muted", title: s.created_at }, ago(s.created_at)),
    sessionActions(app, s, message),
  );
}

async function killSession(app, id, message) {
  try {
    await api(`/api/v2/admin/sessions/${enc(id)}/kill`, { method: "POST" });
  } catch (err) {
    (message || ((t) => { $("#new-error").textContent = t; }))(`kill failed: ${explain(err)}`);
  }
  app.refresh.sessions();
}

export class SessionsRoom {
  constructor(app) {
    this.app = app;
    this.loaded = false;
    $("#sessions-refresh").addEventListener("click", () => this.load());
    $("#new-session").addEventListener("submit", (ev) => { ev.preventDefault(); this.create(); });
  }

  /** Load the list; a failure is shown above it with a Retry button (never thrown). */
  load() {
    return load($("#sessions-error"), "Could not load sessions", () => this.fetchList().catch((err) => {
      if (!this.loaded) fillBody($("#sessions tbody"), [], "Not loaded: see the message above.");
      throw err;
    }));
  }

  async fetchList() {
    const [sessions, agents] = await Promise.all([
      api("/api/v2/admin/sessions?limit=100"),
      api("/api/v2/admin/agents"),
    ]);
    this.loaded = true;
    this.app.agents = new Map(agents.items.map((a) => [a.instance_id, a]));
    const rows = sessions.items.map((s) => sessionRow(this.app, s, { message: (t) => { $("#new-error").textContent = t; } }));
    fillBody($("#sessions tbody"), rows, "No sessions yet.");
    $("#sessions-count").textContent = String(sessions.items.length);
    const select = $("#new-instance");
    const current = select.value;
    const connected = agents.items.filter((x) => x.state === "connected");
    select.replaceChildren(...connected.map((a) => el("option", { value: a.instance_id }, a.instance_id)));
    if (!connected.length) select.append(el("option", { value: "" }, "no connected agent"));
    if (current && connected.some((a) => a.instance_id === current)) select.value = current;
  }

  async create() {
    const out = $("#new-error");
    out.textContent = "";
    const instance = $("#new-instance").value;
    if (!instance) { out.textContent = "No instance has a connected agent."; return; }
    const command = $("#new-command").value.trim();
    await createSession(this.app, instance, command, "", out);
  }
}

/** POST a session (login shell, or `sh -c COMMAND`) and attach to it as controller. */
export async function createSession(app, instanceId, command, name, out) {
  const body = { instance_id: instanceId, cols: 100, rows: 30 };
  if (command) body.command = ["/bin/sh", "-c", command];
  if (name) body.name = name;
  try {
    const created = await api("/api/v2/admin/sessions", { method: "POST", body });
    app.openTerminal(created.id, true);
    app.refresh.sessions.now();
    return created;
  } catch (err) {
    out.textContent = `Could not open a session: ${explain(err)}`;
    return null;
  }
}
