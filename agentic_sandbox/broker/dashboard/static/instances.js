// Instances: the list (state, agent state, host), the instance view (facts, lifecycle actions,
// its sessions, its snapshots, its files, a run-command box, a port preview link, its egress) and the snapshot dialog.

import { clearError, load, showError } from "/static/alerts.js";
import { api, enc } from "/static/api.js";
import { $, badge, confirmAction, el, fillBody, fmtDateTime, fmtMiB, openDialog, ago } from "/static/dom.js";
import { EgressPanel } from "/static/egress.js";
import { RunBox } from "/static/exec.js";
import { FileBrowser } from "/static/files.js";
import { PortPreview } from "/static/ports.js";
import { createSession, sessionRow } from "/static/sessions.js";

// Which lifecycle actions make sense in which state (the server has the final word).
const ENABLED = {
  start: ["shutoff", "crashed", "defined", "unknown"],
  stop: ["running", "paused"],
  restart: ["running"],
  suspend: ["running"],
  resume: ["paused"],
  "force-off": ["running", "paused", "crashed", "blocked"],
  snapshot: ["running", "paused", "shutoff"],
};
const PAST = {
  start: "started", stop: "stopped", restart: "restarted", suspend: "suspended", resume: "resumed",
  "force-off": "powered off",
};

function hostLabel(inst, agent) {
  if (inst.host) return inst.host;
  if (agent && agent.hostname) return `${agent.hostname} (host agent)`;
  return "—";
}

export class InstancesView {
  constructor(app) {
    this.app = app;
    this.items = [];
    this.selected = null;
    this.loaded = false;
    this.files = new FileBrowser(app, $("#iv-files"));
    this.runBox = new RunBox(app, $("#iv-exec"));
    this.egress = new EgressPanel(app, $("#iv-egress"));
    this.ports = new PortPreview(app, $("#iv-ports"));
    $("#instances-refresh").addEventListener("click", () => this.load());
    $("#iv-close").addEventListener("click", () => this.select(null));
    for (const btn of document.querySelectorAll("#iv-actions [data-action]")) {
      btn.addEventListener("click", () => this.action(btn.dataset.action));
    }
    $("#iv-new-session").addEventListener("submit", (ev) => { ev.preventDefault(); this.newSession(); });
    $("#snapshot-form").addEventListener("submit", (ev) => { ev.preventDefault(); this.snapshot(); });
    $("#snapshot-cancel").addEventListener("click", () => $("#snapshot-dialog").close());
  }

  /** Load the list; a failure is shown above it with a Retry button (never thrown). */
  load() {
    return load($("#instances-error"), "Could not load instances", () => this.fetchList().catch((err) => {
      // never loaded: say so in the table rather than "No instances yet"
      if (!this.loaded) fillBody($("#instances tbody"), [], "Not loaded: see the message above.");
      throw err;
    }));
  }

  async fetchList() {
    const [instances, agents] = await Promise.all([
      api("/api/v2/admin/instances"),
      api("/api/v2/admin/agents"),
    ]);
    this.loaded = true;
    this.app.agents = new Map(agents.items.map((a) => [a.instance_id, a]));
    this.items = instances.items;
    const rows = this.items.map((inst) => this.row(inst));
    fillBody($("#instances tbody"), rows, "No instances yet. Create one, or enroll a host agent.");
    $("#instances-count").textContent = String(this.items.length);
    if (this.selected) {
      const fresh = this.items.find((i) => i.id === this.selected);
      if (fresh) this.renderFacts(fresh);
      else this.gone();
    }
  }

  row(inst) {
    const agent = this.app.agents.get(inst.id);
    const current = inst.id === this.selected;
    return el("tr", { dataset: { instance: inst.id, state: inst.state }, class: current ? "selected" : null },
      el("th", { scope: "row" },
        el("button", { type: "button", class: "link open-instance", "aria-label": `Open instance ${inst.id}`,
          "aria-current": current ? "true" : null, onclick: () => this.select(inst.id) }, inst.id)),
      el("td", { class: "inst-state", title: inst.state_reason || "" }, badge(inst.state)),
      el("td", { class: "inst-agent" }, badge(inst.agent_state)),
      el("td", { class: "inst-host" }, hostLabel(inst, agent)),
      el("td", {}, inst.image || "—"),
      el("td", {}, inst.loadout || "—"),
      el("td", { class: "nowrap" }, inst.vcpus ? `${inst.vcpus} vCPU · ${fmtMiB(inst.memory_mib)}` : "—"),
      el("td", {}, inst.network_policy || "—"),
    );
  }

  // ---- the instance view --------------------------------------------------------------------
  async select(id) {
    this.selected = id;
    for (const tr of document.querySelectorAll("#instances tbody tr[data-instance]")) {
      const on = tr.dataset.instance === id;
      tr.classList.toggle("selected", on);
      const btn = tr.querySelector("button.open-instance");
      if (on) btn.setAttribute("aria-current", "true"); else btn.removeAttribute("aria-current");
    }
    const view = $("#instance-view");
    if (!id) { view.hidden = true; return; }
    view.hidden = false;
    $("#iv-id").textContent = id;
    $("#iv-error").textContent = "";
    $("#iv-message").textContent = "";
    $("#iv-new-error").textContent = "";
    const inst = this.items.find((i) => i.id === id);
    if (inst) this.renderFacts(inst);
    view.scrollIntoView({ block: "nearest" });
    $("#iv-title").focus({ preventScroll: true });
    this.runBox.open(id);
    this.ports.open(id);
    await Promise.all([this.loadSessions(), this.loadSnapshots(), this.files.open(id), this.egress.open(id)]);
  }

  gone() {
    $("#iv-message").textContent = `Instance ${this.selected} no longer exists.`;
    $("#iv-state").replaceChildren(badge("deleted"));
    for (const btn of document.querySelectorAll("#iv-actions [data-action]")) btn.disabled = true;
  }

  renderFacts(inst) {
    const agent = this.app.agents.get(inst.id);
    $("#iv-state").replaceChildren(badge(inst.state));
    const facts = [
      ["State", inst.state + (inst.state_reason ? ` (${inst.state_reason})` : "")],
      ["Agent", agent ? `${inst.agent_state}${agent.agent_version ? ` · v${agent.agent_version}` : ""}` : inst.agent_state],
      ["Host", hostLabel(inst, agent)],
      ["Image", inst.image || "—"],
      ["Loadout", inst.loadout || "—"],
      ["Resources", inst.vcpus ? `${inst.vcpus} vCPU · ${fmtMiB(inst.memory_mib)}` : "—"],
      ["Network", inst.network_policy || "—"],
      ["SSH port", inst.ssh_port ? String(inst.ssh_port) : "—"],
      ["Owner", inst.owner],
      ["Created", fmtDateTime(inst.created_at)],
    ];
    $("#iv-facts").replaceChildren(...facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", { dataset: { fact: k.toLowerCase().replace(" ", "-") } }, v))));
    const operator = this.app.canOperate();
    for (const btn of document.querySelectorAll("#iv-actions [data-action]")) {
      const allowed = ENABLED[btn.dataset.action];
      btn.disabled = !operator || inst.state === "provisioning" || (allowed ? !allowed.includes(inst.state) : false);
    }
    $("#iv-new-session button[type=submit]").disabled = !operator;
  }

  async loadSessions() {
    const id = this.selected;
    if (!id) return;
    const out = $("#iv-new-error");
    await load(out, "Could not list this instance's sessions", async () => {
      const list = await api(`/api/v2/admin/sessions?instance_id=${enc(id)}&limit=50`);
      if (id !== this.selected) return;
      const rows = list.items.map((s) => sessionRow(this.app, s, { withInstance: false, message: (t) => { out.textContent = t; } }));
      fillBody($("#iv-sessions tbody"), rows, "No sessions on this instance yet.");
    });
  }

  async loadSnapshots() {
    const id = this.selected;
    if (!id) return;
    const list = $("#iv-snapshots");
    await load($("#iv-snapshots-error"), "Could not list snapshots", async () => {
      const snaps = await api(`/api/v2/admin/instances/${enc(id)}/snapshots`);
      if (id !== this.selected) return;
      if (!snaps.items.length) { list.replaceChildren(el("li", { class: "muted" }, "No snapshots.")); return; }
      list.replaceChildren(...snaps.items.map((s) => el("li", { dataset: { snapshot: s.name } },
        el("strong", {}, s.name), " ",
        el("span", { class: "muted" }, `${s.kind} · ${ago(s.created_at)}`),
        s.kind === "memory" && this.app.canOperate()
          ? el("button", { type: "button", class: "small", "aria-label": `Create an instance from snapshot ${s.name}`,
            onclick: () => this.app.openCreate({ fromSnapshot: `${id}/${s.name}` }) }, "New instance from it")
          : null)));
    });
  }

  async newSession() {
    const out = $("#iv-new-error");
    out.textContent = "";
    await createSession(this.app, this.selected, $("#iv-command").value.trim(), $("#iv-session-name").value.trim(), out);
    this.loadSessions();
  }

  async action(action) {
    const id = this.selected;
    if (!id) return;
    if (action === "snapshot") {
      $("#snapshot-error").textContent = "";
      $("#snapshot-name").value = "";
      $("#snapshot-target").textContent = id;
      openDialog($("#snapshot-dialog"), $("#snapshot-name"));
      return;
    }
    if (action === "delete" || action === "force-off") {
      const ok = await confirmAction(action === "delete"
        ? { title: `Delete ${id}?`, message: `The instance ${id}, its disks, snapshots and sessions' agent go away. This cannot be undone.`, confirmLabel: "Delete instance", danger: true }
        : { title: `Power off ${id}?`, message: "The VM is cut off at once, like pulling the plug; unsaved work inside is lost.", confirmLabel: "Power off", danger: true });
      if (!ok) return;
    }
    const err = $("#iv-error");
    const msg = $("#iv-message");
    clearError(err);
    msg.textContent = `${action}…`;
    const buttons = document.querySelectorAll("#iv-actions [data-action]");
    buttons.forEach((b) => { b.dataset.wasDisabled = String(b.disabled); b.disabled = true; });
    try {
      if (action === "delete") {
        await api(`/api/v2/admin/instances/${enc(id)}`, { method: "DELETE" });
        $("#instances-message").textContent = `Instance ${id} deleted.`;
        this.select(null);
      } else {
        const body = action === "stop" ? {} : undefined;
        const inst = await api(`/api/v2/admin/instances/${enc(id)}/${action}`, { method: "POST", body });
        msg.textContent = `Instance ${id} ${PAST[action] || action}: now ${inst.state}.`;
      }
    } catch (e) {
      msg.textContent = "";
      showError(err, e, { what: `${action} failed`, retry: () => this.action(action) });
      buttons.forEach((b) => { b.disabled = b.dataset.wasDisabled === "true"; });
    }
    await this.load();
  }

  async snapshot() {
    const id = this.selected;
    const name = $("#snapshot-name").value.trim();
    const out = $("#snapshot-error");
    out.textContent = "";
    const submit = $("#snapshot-form button[type=submit]");
    submit.disabled = true;
    try {
      await api(`/api/v2/admin/instances/${enc(id)}/snapshots`, {
        method: "POST",
        body: { name, memory: $("#snapshot-memory").checked, description: $("#snapshot-description").value.trim() },
      });
      $("#snapshot-dialog").close();
      $("#iv-message").textContent = `Snapshot ${name} of ${id} taken.`;
      await this.loadSnapshots();
    } catch (err) {
      const field = (err.errors || []).find((e) => e.field);
      if (field) out.textContent = `${field.field.replace(/^body\./, "")}: ${field.message}`;
      else showError(out, err, { retry: () => this.snapshot() });
    } finally {
      submit.disabled = false;
    }
  }
}
