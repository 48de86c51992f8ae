// The instance view's egress panel: the instance's policy, its allowlist and limits
// (GET /api/v2/admin/instances/{id}/egress), the rules editable by operators (PUT, which
// replaces the whole list; a 422 names the bad rule as body.allow.N, shown next to that rule),
// and the latest `egress.*` events of the instance with their verdicts.
//
// The events: /api/v1/events only pages forward from a cursor, so the panel reads the window of
// the newest WINDOW events on the server (at most WINDOW / 200 pages, filtered by the server to
// `type=egress.*&instance_id=…`), keeps the newest SHOWN, and then adds what the page's live
// event feed brings (dashboard.js hands egress.* events over). An egress event older than that
// window is not shown here; the events API and the audit log have them all.

import { clearError, showError } from "/static/alerts.js";
import { api, enc } from "/static/api.js";
import { el, fillBody, fmtTime } from "/static/dom.js";
import { fmtBytes } from "/static/files.js";

const WINDOW = 2000;
const PAGE = 200;
const SHOWN = 50;
const VERDICT_CLASS = { allowed: "ok", denied: "warn", failed: "bad" };

/** A rule's text form, as the API and provision-vm.sh --allow take it. */
export function ruleText(rule) {
  if (typeof rule === "string") return rule;
  const host = rule.host.includes(":") ? `[${rule.host}]` : rule.host;
  const methods = rule.methods && rule.methods.length ? `:${rule.methods.join(",")}` : "";
  return `${host}:${rule.port}${methods}`;
}

export class EgressPanel {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.instance = null;
    this.config = null;
    this.events = []; // newest first
    this.build();
  }

  q(sel) { return this.root.querySelector(sel); }

  build() {
    this.root.replaceChildren(
      el("h3", {}, "Egress"),
      el("p", { id: "eg-policy" }),
      el("p", { id: "eg-message", class: "muted", role: "status" }),
      el("p", { id: "eg-error", class: "error", role: "alert" }),
      el("form", { id: "eg-form", "aria-label": "Egress allowlist", onsubmit: (ev) => { ev.preventDefault(); this.save(); } },
        el("fieldset", { id: "eg-fieldset" },
          el("legend", {}, "Allowed destinations (HOST:PORT, *.suffix:PORT, HOST:80:GET,HEAD)"),
          el("ol", { id: "eg-rules", class: "plain eg-rules" }),
          el("div", { class: "inline-form" },
            el("button", { id: "eg-add", type: "button", onclick: () => this.addRow("", true) }, "Add rule"),
            el("label", {}, "Policy ",
              el("select", { id: "eg-network" },
                el("option", { value: "allowlist" }, "allowlist (the rules, through the host's proxy)"),
                el("option", { value: "isolated" }, "isolated (no egress at all)"))),
            el("button", { id: "eg-save", type: "submit", class: "primary" }, "Save rules")))),
      el("h4", {}, "Latest connections"),
      el("p", { id: "eg-events-error", class: "error", role: "alert" }),
      el("div", { class: "table-wrap" },
        el("table", { id: "eg-events" },
          el("caption", { class: "sr-only" }, "The instance's latest egress events, newest first"),
          el("thead", {}, el("tr", {},
            ...["Time", "Verdict", "Destination", "Address", "Reason", "Bytes up/down", "Duration"].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody"))),
    );
  }

  async open(instanceId) {
    if (instanceId !== this.instance) {
      this.instance = instanceId;
      this.config = null;
      this.events = [];
      this.q("#eg-message").textContent = "";
      this.q("#eg-rules").replaceChildren();
      fillBody(this.q("#eg-events tbody"), [], "Loading…");
    }
    await Promise.all([this.load(), this.loadEvents()]);
  }

  async load() {
    const id = this.instance;
    const error = this.q("#eg-error");
    let config;
    try {
      config = await api(`/api/v2/admin/instances/${enc(id)}/egress`);
    } catch (err) {
      if (id === this.instance) showError(error, err, { what: "Could not read the egress policy", retry: () => this.load(), always: true });
      return;
    }
    if (id !== this.instance) return;
    clearError(error);
    this.render(config);
  }

  render(config) {
    this.config = config;
    this.root.dataset.network = config.network;
    const limits = config.limits || {};
    const bw = limits.bandwidth_bytes_per_second ? `${fmtBytes(limits.bandwidth_bytes_per_second)}/s each way` : "no bandwidth limit";
    const words = {
      allowlist: "allowlist: only the rules below, through the host's proxy",
      isolated: "isolated: no egress (the agent link only)",
      nat: "nat: the whole network through NAT, no rules apply (fixed while the instance exists)",
    };
    this.q("#eg-policy").replaceChildren(
      "Policy: ", el("strong", { id: "eg-network-now" }, config.network), " — ",
      words[config.network] || config.network,
      config.network === "nat" ? "" : ` · at most ${limits.max_connections} connections at once, ${bw}`);
    const rows = config.allow.map(ruleText);
    this.q("#eg-rules").replaceChildren();
    for (const text of rows) this.addRow(text);
    if (!rows.length) this.q("#eg-rules").append(el("li", { class: "muted eg-empty" }, "No rules: nothing is allowed."));
    const nat = config.network === "nat";
    this.q("#eg-form").hidden = nat;
    if (!nat) this.q("#eg-network").value = config.network;
    const editable = this.app.canOperate() && !nat;
    this.q("#eg-fieldset").disabled = !editable;
    for (const c of this.root.querySelectorAll("#eg-add, #eg-save, .eg-remove")) c.hidden = !editable;
  }

  addRow(text, focus = false) {
    const list = this.q("#eg-rules");
    const empty = list.querySelector(".eg-empty");
    if (empty) empty.remove();
    const input = el("input", { class: "eg-rule", value: text, autocomplete: "off", spellcheck: "false", size: "36", "aria-label": "Rule" });
    const error = el("span", { class: "field-error eg-rule-error", "aria-live": "polite" });
    const li = el("li", { class: "eg-row" }, input, " ",
      el("button", { type: "button", class: "small eg-remove", "aria-label": "Remove this rule", onclick: () => li.remove() }, "Remove"),
      " ", error);
    list.append(li);
    if (focus) input.focus();
    return li;
  }

  async save() {
    const id = this.instance;
    const rows = [...this.root.querySelectorAll("#eg-rules .eg-row")];
    for (const li of rows) { li.querySelector(".eg-rule-error").textContent = ""; delete li.dataset.invalid; }
    const sent = rows.filter((li) => li.querySelector(".eg-rule").value.trim() !== ""); // blank rows are dropped
    const body = { network: this.q("#eg-network").value, allow: sent.map((li) => li.querySelector(".eg-rule").value.trim()) };
    const error = this.q("#eg-error");
    const message = this.q("#eg-message");
    clearError(error);
    message.textContent = "";
    const save = this.q("#eg-save");
    save.disabled = true;
    try {
      const out = await api(`/api/v2/admin/instances/${enc(id)}/egress`, { method: "PUT", body });
      if (id !== this.instance) return;
      this.render(out);
      message.textContent = `Saved: ${out.allow.length} rules, policy ${out.network}; new connections follow them at once.`;
    } catch (err) {
      if (id !== this.instance) return;
      let named = 0;
      for (const e of err.errors || []) {
        const m = /^body\.allow\.(\d+)/.exec(e.field || "");
        const li = m && sent[Number(m[1])];
        if (!li) continue;
        li.dataset.invalid = "true";
        li.querySelector(".eg-rule-error").textContent = e.message;
        named++;
      }
      showError(error, err, { what: named ? "The rules were not saved (the bad rule is marked)" : "The rules were not saved" });
      const first = this.root.querySelector('#eg-rules .eg-row[data-invalid="true"] .eg-rule');
      if (first) first.focus();
    } finally {
      save.disabled = false;
    }
  }

  async loadEvents() {
    const id = this.instance;
    const error = this.q("#eg-events-error");
    const found = [];
    try {
      const head = await api("/api/v1/events?limit=1");
      let after = Math.max(0, head.last_seq - WINDOW);
      for (let i = 0; i < WINDOW / PAGE; i++) {
        const page = await api(`/api/v1/events?type=${enc("egress.*")}&instance_id=${enc(id)}&after=${after}&limit=${PAGE}`);
        found.push(...page.items);
        if (page.items.length < PAGE) break;
        after = page.items[page.items.length - 1].seq;
      }
    } catch (err) {
      if (id !== this.instance) return;
      showError(error, err, { what: "Could not read the egress events", retry: () => this.loadEvents(), always: true });
      if (!this.events.length) fillBody(this.q("#eg-events tbody"), [], "Not loaded: see the message above.");
      return;
    }
    if (id !== this.instance) return;
    clearError(error);
    const seen = new Set(this.events.map((e) => e.seq));
    this.events = [...this.events, ...found.filter((e) => !seen.has(e.seq))].sort((a, b) => b.seq - a.seq).slice(0, SHOWN);
    this.renderEvents();
  }

  /** A live event from the page's feed (dashboard.js passes every egress.* event). */
  onEvent(ev) {
    if (!this.instance || ev.instance_id !== this.instance) return;
    if (this.events.some((e) => e.seq === ev.seq)) return;
    this.events = [ev, ...this.events].sort((a, b) => b.seq - a.seq).slice(0, SHOWN);
    this.renderEvents();
    if (ev.type === "egress.rules.changed" && !this.root.querySelector("#eg-rules .eg-rule:focus")) this.load();
  }

  renderEvents() {
    fillBody(this.q("#eg-events tbody"), this.events.map((ev) => this.eventRow(ev)), "No egress events of this instance yet.");
  }

  eventRow(ev) {
    const d = ev.data || {};
    if (ev.type === "egress.rules.changed") {
      return el("tr", { dataset: { seq: String(ev.seq), type: ev.type } },
        el("td", { class: "muted nowrap" }, fmtTime(ev.time)),
        el("td", {}, el("span", { class: "badge badge-info" }, "rules")),
        el("td", { colspan: "5" }, `rules replaced by ${ev.actor || "?"}: ${(d.allow || []).join(", ") || "none"} (policy ${d.network})`));
    }
    const verdict = d.verdict || ev.type.replace(/^egress\./, "");
    const dest = `${d.method && d.kind !== "connect" ? `${d.method} ` : ""}${d.host || "?"}:${d.port ?? "?"}`;
    return el("tr", { dataset: { seq: String(ev.seq), type: ev.type, verdict } },
      el("td", { class: "muted nowrap" }, fmtTime(ev.time)),
      el("td", {}, el("span", { class: `badge badge-${VERDICT_CLASS[verdict] || "off"}`, dataset: { verdict } }, verdict)),
      el("td", { class: "mono" }, dest),
      el("td", { class: "mono" }, d.address || "—"),
      el("td", { title: d.detail || "" }, d.reason || "ok"),
      el("td", { class: "nowrap" }, `${fmtBytes(d.bytes_up || 0)} / ${fmtBytes(d.bytes_down || 0)}`),
      el("td", { class: "nowrap" }, d.duration_ms !== undefined ? `${d.duration_ms} ms` : ""));
  }
}
