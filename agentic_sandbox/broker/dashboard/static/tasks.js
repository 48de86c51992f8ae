// Tasks (GET /api/v2/admin/missions): state per task with per-state totals, refreshed live on
// `task.*` events; a task's run is a PTY session that can be observed or replayed.

import { load } from "/static/alerts.js";
import { api } from "/static/api.js";
import { $, badge, el, fillBody, shortId, ago } from "/static/dom.js";

const FILTERS = {
  "": null,
  active: "submitted,working,input-required,auth-required",
  completed: "completed",
  failed: "failed,rejected",
  canceled: "canceled",
};

export class TasksView {
  constructor(app) {
    this.app = app;
    this.changed = new Set();
    $("#tasks-refresh").addEventListener("click", () => this.load());
    $("#tasks-state").addEventListener("change", () => this.load());
    $("#tasks-more").addEventListener("click", () => this.load({ more: true }));
    this.cursor = null;
    this.items = [];
    this.loaded = false;
  }

  onEvent(ev) { if (ev.task_id) this.changed.add(ev.task_id); }

  /** Load the list; a failure is shown above it with a Retry button (never thrown). */
  load({ more = false } = {}) {
    return load($("#tasks-error"), "Could not load tasks", () => this.fetchList({ more }).catch((err) => {
      if (!this.loaded) fillBody($("#tasks tbody"), [], "Not loaded: see the message above.");
      throw err;
    }));
  }

  async fetchList({ more = false } = {}) {
    const params = new URLSearchParams({ limit: "50" });
    const states = FILTERS[$("#tasks-state").value];
    if (states) params.set("state", states);
    if (more && this.cursor) params.set("cursor", this.cursor);
    const page = await api(`/api/v2/admin/missions?${params}`);
    this.loaded = true;
    this.items = more ? this.items.concat(page.items) : page.items;
    this.cursor = page.next_cursor;
    $("#tasks-more").hidden = !this.cursor;
    const flash = this.changed;
    this.changed = new Set();
    fillBody($("#tasks tbody"), this.items.map((t) => this.row(t, flash.has(t.id))),
      states ? "No tasks in this state." : "No tasks yet. Tasks arrive over A2A (or the v1 API).");
    const totals = page.totals || {};
    const order = ["submitted", "working", "input-required", "auth-required", "completed", "failed", "canceled", "rejected"];
    $("#task-totals").replaceChildren(...order.filter((s) => totals[s]).map((s) =>
      el("li", { dataset: { state: s } }, badge(s, `${s} ${totals[s]}`))));
  }

  row(t, flash) {
    const actions = el("td", { class: "actions" });
    if (t.session_id) {
      actions.append(
        el("button", { type: "button", class: "task-observe", "aria-label": `Observe the run of task ${shortId(t.id)}`,
          onclick: () => this.app.openTerminal(t.session_id, false) }, "Observe"),
        el("button", { type: "button", class: "task-recording", "aria-label": `Play the recording of task ${shortId(t.id)}`,
          onclick: () => this.app.openPlayer(t.session_id, `task ${shortId(t.id)}`) }, "Recording"),
      );
    }
    return el("tr", { dataset: { task: t.id, state: t.state }, class: flash ? "flash" : null },
      el("td", { title: t.id }, el("code", {}, shortId(t.id))),
      el("td", {}, t.instance_id),
      el("td", { class: "state" }, badge(t.state)),
      el("td", {}, t.skill || "—"),
      el("td", {}, t.exit_code === null || t.exit_code === undefined ? "—" : String(t.exit_code)),
      el("td", { class: "wrap task-message" }, t.status_message || ""),
      el("td", { class: "muted", title: t.status_at }, ago(t.status_at)),
      actions);
  }
}
