// Hosts (GET /api/v2/admin/hosts): each hypervisor with its state (reachable or not, and
// draining), capacity, committed resources and instance count. Admins drain a host (POST
// …/{name}/drain: no new placements, its warm pools move) and undrain it (DELETE …/drain);
// what the drain did with the host's warm pools is said under the table.

import { clearError, load, showError } from "/static/alerts.js";
import { api, ApiError, enc } from "/static/api.js";
import { $, badge, el, fillBody } from "/static/dom.js";

function gib(mib) {
  return mib >= 1024 ? `${(mib / 1024).toFixed(mib % 1024 ? 1 : 0)} GiB` : `${mib} MiB`;
}

/** What a drain answer says about the host's warm pools, in one sentence. */
export function poolsSentence(host) {
  const pools = host.pools || [];
  if (!pools.length) return `${host.name} is draining: no new placements there; it had no warm pools.`;
  const parts = pools.map((p) => (p.state === "moving"
    ? `pool ${p.key} is moving to another host (operation ${p.operation_id.slice(0, 8)})`
    : `pool ${p.key} cannot move: ${p.reason}`));
  return `${host.name} is draining: no new placements there; ${parts.join("; ")}.`;
}

export class HostsView {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.build();
  }

  build() {
    this.root.replaceChildren(
      el("div", { class: "panel-head" },
        el("h2", { id: "hosts-title" }, "Hosts ", el("span", { id: "hosts-count", class: "count" })),
        el("span", { class: "spacer" }),
        el("button", { id: "hosts-refresh", type: "button", onclick: () => this.load() }, "Refresh")),
      el("p", { id: "hosts-message", class: "muted status-line", role: "status" }),
      el("p", { id: "hosts-error", class: "error", role: "alert" }),
      el("div", { class: "table-wrap" },
        el("table", { id: "hosts" },
          el("caption", { class: "sr-only" }, "Hypervisor hosts with their state, capacity, committed resources and instances"),
          el("thead", {}, el("tr", {},
            ...["Host", "State", "vCPUs committed / host", "Memory committed / host", "Free memory", "Instances", ""]
              .map((h) => el("th", { scope: "col" }, h)))),
          el("tbody"))),
    );
  }

  async load() {
    await load($("#hosts-error", this.root), "Could not load hosts", async () => {
      const listing = await api("/api/v2/admin/hosts");
      $("#hosts-count", this.root).textContent = String(listing.items.length);
      fillBody($("#hosts tbody", this.root), listing.items.map((h) => this.row(h)), "No hosts.");
    });
  }

  row(h) {
    const admin = this.app.isAdmin();
    const toggle = el("button", {
      type: "button",
      class: h.draining ? "host-undrain" : "host-drain",
      "aria-label": `${h.draining ? "Undrain" : "Drain"} ${h.name}`,
      disabled: !admin,
      title: admin ? "" : "only admins drain hosts",
      onclick: () => this.setDraining(h.name, !h.draining),
    }, h.draining ? "Undrain" : "Drain");
    const state = [badge(h.state, h.state)];
    if (h.draining) state.push(" ", badge("draining", "draining"));
    return el("tr", { dataset: { host: h.name, state: h.state, draining: String(h.draining) } },
      el("td", { title: h.uri }, el("code", {}, h.name)),
      el("td", { class: "host-state", title: h.reason || "" }, ...state),
      el("td", { class: "host-vcpus" }, `${h.committed_vcpus} / ${h.cpus}`),
      el("td", { class: "host-memory" }, `${gib(h.committed_memory_mib)} / ${gib(h.memory_mib)}`),
      el("td", {}, gib(h.free_memory_mib)),
      el("td", { class: "host-instances" }, String(h.instances)),
      el("td", { class: "actions" }, toggle));
  }

  async setDraining(name, draining) {
    const message = $("#hosts-message", this.root);
    const error = $("#hosts-error", this.root);
    message.textContent = "";
    clearError(error);
    try {
      const host = await api(`/api/v2/admin/hosts/${enc(name)}/drain`, { method: draining ? "POST" : "DELETE" });
      message.textContent = draining ? poolsSentence(host) : `${name} takes new placements again.`;
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return;
      showError(error, err, { what: `Could not ${draining ? "drain" : "undrain"} ${name}` });
      return;
    }
    await this.load();
  }
}
