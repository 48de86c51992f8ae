// Loadouts (GET /api/v2/admin/loadouts): each name at its active version; a name's versions
// (GET …/{name}/versions), a line diff between two of them, and activation with the version
// this view saw active as `expected_version` — a 409 (someone moved it since) is said plainly
// and the versions are reloaded.

import { clearError, load, showError } from "/static/alerts.js";
import { api, ApiError, enc } from "/static/api.js";
import { $, badge, el, fillBody, fmtDateTime } from "/static/dom.js";

/** JSON with sorted keys, two-space indented: equal content, equal text. */
export function stableJson(value) {
  const sort = (v) => {
    if (Array.isArray(v)) return v.map(sort);
    if (v && typeof v === "object") {
      return Object.fromEntries(Object.keys(v).sort().map((k) => [k, sort(v[k])]));
    }
    return v;
  };
  return JSON.stringify(sort(value), null, 2);
}

/** A line diff (longest common subsequence): [{op: " " | "-" | "+", line}]. */
export function lineDiff(before, after) {
  const a = before.split("\n");
  const b = after.split("\n");
  const n = a.length;
  const m = b.length;
  const lcs = Array.from({ length: n + 1 }, () => new Uint32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i][j] = a[i] === b[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
    }
  }
  const out = [];
  let i = 0;
  let j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { out.push({ op: " ", line: a[i] }); i++; j++; }
    else if (lcs[i + 1][j] >= lcs[i][j + 1]) out.push({ op: "-", line: a[i++] });
    else out.push({ op: "+", line: b[j++] });
  }
  while (i < n) out.push({ op: "-", line: a[i++] });
  while (j < m) out.push({ op: "+", line: b[j++] });
  return out;
}

function extendsText(v) {
  return v.extends ? `${v.extends.name}@${v.extends.version}` : "—";
}

export class LoadoutsView {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.name = null; // the loadout whose versions are shown
    this.versions = null; // its last loaded version list
    this.build();
  }

  build() {
    this.root.replaceChildren(
      el("div", { class: "panel-head" },
        el("h2", { id: "loadouts-title" }, "Loadouts"),
        el("span", { class: "spacer" }),
        el("button", { id: "loadouts-refresh", type: "button", onclick: () => this.load() }, "Refresh")),
      el("p", { id: "loadouts-error", class: "error", role: "alert" }),
      el("div", { class: "table-wrap" },
        el("table", { id: "loadouts" },
          el("caption", { class: "sr-only" }, "Loadouts at their active version"),
          el("thead", {}, el("tr", {},
            ...["Loadout", "Active", "Owner", "Description", "Network", ""].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody"))),
      el("div", { id: "loadout-versions", hidden: true },
        el("h3", { id: "lv-title", tabindex: "-1" }),
        el("p", { id: "lv-message", class: "muted", role: "status" }),
        el("p", { id: "lv-error", class: "error", role: "alert" }),
        el("div", { class: "table-wrap" },
          el("table", { id: "lv-table" },
            el("caption", { class: "sr-only" }, "Versions of the loadout"),
            el("thead", {}, el("tr", {},
              ...["Version", "State", "Digest", "Extends", "Saved by", "Saved", ""].map((h) => el("th", { scope: "col" }, h)))),
            el("tbody"))),
        el("form", { id: "lv-diff-form", class: "inline-form", "aria-label": "Compare two versions",
          onsubmit: (ev) => { ev.preventDefault(); this.showDiff(); } },
          el("label", {}, "From ", el("select", { id: "lv-diff-a" })),
          el("label", {}, "to ", el("select", { id: "lv-diff-b" })),
          el("label", {}, el("input", { id: "lv-diff-resolved", type: "checkbox" }), " resolved (extends applied)"),
          el("button", { type: "submit" }, "Compare")),
        el("pre", { id: "lv-diff", class: "diff", hidden: true, "aria-label": "Differences between the versions" })),
    );
  }

  async load() {
    // alerts.load runs (and its Retry re-runs) the fetch and the rendering together
    await load($("#loadouts-error", this.root), "Could not load loadouts", async () => {
      const listing = await api("/api/v2/admin/loadouts");
      fillBody($("#loadouts tbody", this.root), listing.items.map((lo) => this.row(lo)), "No loadouts.");
      if (this.name) await this.showVersions(this.name, { focus: false });
    });
  }

  row(lo) {
    return el("tr", { dataset: { loadout: lo.name } },
      el("td", {}, el("code", {}, lo.name)),
      el("td", { class: "lo-active" }, `v${lo.version}`),
      el("td", {}, lo.shared ? `${lo.owner} (shared)` : lo.owner),
      el("td", { class: "wrap" }, lo.description || ""),
      el("td", {}, lo.network),
      el("td", { class: "actions" },
        el("button", { type: "button", class: "lo-versions", "aria-label": `Versions of ${lo.name}`,
          onclick: () => this.showVersions(lo.name) }, "Versions")));
  }

  async showVersions(name, { focus = true } = {}) {
    const box = $("#loadout-versions", this.root);
    let doc;
    try {
      doc = await api(`/api/v2/admin/loadouts/${enc(name)}/versions`);
    } catch (err) { // (not alerts.load: a success must not clear what an activation said)
      showError($("#lv-error", this.root), err, {
        what: `Could not load the versions of ${name}`, retry: () => this.showVersions(name), always: true,
      });
      return;
    }
    if (this.name !== name) { // another loadout: what was said about the last one goes
      $("#lv-message", this.root).textContent = "";
      clearError($("#lv-error", this.root));
      $("#lv-diff", this.root).hidden = true;
    }
    this.name = name;
    this.versions = doc;
    box.hidden = false;
    box.dataset.loadout = name;
    box.dataset.active = String(doc.active_version);
    $("#lv-title", this.root).textContent = `Versions of ${name} (active: v${doc.active_version})`;
    fillBody($("#lv-table tbody", this.root), doc.items.map((v) => this.versionRow(v, doc)), "No versions.");
    for (const [id, pick] of [["#lv-diff-a", -2], ["#lv-diff-b", -1]]) {
      const select = $(id, this.root);
      const keep = select.value;
      select.replaceChildren(...doc.items.map((v) => el("option", { value: String(v.version) }, `v${v.version}`)));
      const fallback = doc.items[Math.max(0, doc.items.length + pick)];
      select.value = doc.items.some((v) => String(v.version) === keep) ? keep : String(fallback ? fallback.version : "");
    }
    if (focus) $("#lv-title", this.root).focus();
  }

  versionRow(v, doc) {
    const canChange = this.app.canOperate() && (!doc.shared || this.app.isAdmin());
    const activate = el("button", {
      type: "button", class: "lv-activate", "aria-label": `Activate version ${v.version}`,
      disabled: v.active || !canChange, onclick: () => this.activate(v.version),
    }, "Activate");
    return el("tr", { dataset: { version: String(v.version), active: String(v.active) } },
      el("td", {}, `v${v.version}`),
      el("td", {}, v.active ? badge("ready", "active") : ""),
      el("td", { title: v.digest }, el("code", {}, v.digest.slice(0, 12))),
      el("td", {}, extendsText(v)),
      el("td", {}, v.created_by),
      el("td", { class: "muted" }, fmtDateTime(v.created_at)),
      el("td", { class: "actions" }, activate));
  }

  async activate(version) {
    const name = this.name;
    const expected = this.versions.active_version; // what this view saw active
    const message = $("#lv-message", this.root);
    const error = $("#lv-error", this.root);
    message.textContent = "";
    clearError(error);
    try {
      await api(`/api/v2/admin/loadouts/${enc(name)}/activate`, {
        method: "POST", body: { version, expected_version: expected },
      });
      message.textContent = `Version ${version} of ${name} is active (was v${expected}). Running instances keep theirs.`;
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return;
      if (err instanceof ApiError && err.status === 409) {
        const now = err.problem.active_version;
        error.textContent = `Version ${version} was not activated: the active version of ${name} ` +
          `changed since this list was loaded (it is v${now} now, not v${expected}). ` +
          "The versions are reloaded; check them and try again.";
        error.dataset.code = "conflict";
      } else {
        showError(error, err, { what: `Could not activate version ${version}` });
        error.dataset.code = "error";
      }
    }
    await this.load();
  }

  async showDiff() {
    const a = $("#lv-diff-a", this.root).value;
    const b = $("#lv-diff-b", this.root).value;
    const resolved = $("#lv-diff-resolved", this.root).checked;
    const out = $("#lv-diff", this.root);
    await load($("#lv-error", this.root), "Could not compare", async () => {
      const docs = await Promise.all([a, b].map((v) => api(`/api/v2/admin/loadouts/${enc(this.name)}/versions/${enc(v)}`)));
      this.renderDiff(out, a, b, resolved, docs);
    });
  }

  renderDiff(out, a, b, resolved, docs) {
    const text = (d) => stableJson(resolved ? d.resolved : { spec: d.spec, extends: d.extends });
    const lines = lineDiff(text(docs[0]), text(docs[1]));
    const changed = lines.filter((l) => l.op !== " ").length;
    out.replaceChildren(
      el("span", { class: "diff-head" }, changed ? `v${a} → v${b}: ${changed} changed lines\n` : `v${a} and v${b} are the same\n`),
      ...lines.map((l) => el("span", {
        class: l.op === "+" ? "diff-add" : l.op === "-" ? "diff-del" : "diff-same",
        dataset: { op: l.op === " " ? "same" : l.op === "+" ? "add" : "del" },
      }, `${l.op} ${l.line}\n`)));
    out.hidden = false;
    out.dataset.changed = String(changed);
  }
}
