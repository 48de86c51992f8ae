// The instance view's port preview: a port of the instance (a dev server an agent started) as
// a link to the authenticated reverse proxy, `/api/v2/admin/instances/{id}/ports/{port}/`,
// opened in a new tab with the dashboard's cookie. The proxy answers the guest's page under a
// sandboxing Content-Security-Policy (no same-origin: the page cannot act as the operator), so
// a page's own scripts that call back to its origin may not work there; `sandboxctl instance
// port-forward ID PORT` gives a plain local port for those. Operators only (the server refuses
// viewers anyway).

import { enc } from "/static/api.js";
import { el } from "/static/dom.js";

export class PortPreview {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.instance = null;
    this.build();
  }

  q(sel) { return this.root.querySelector(sel); }

  build() {
    this.root.replaceChildren(
      el("h3", {}, "Ports"),
      el("form", { id: "pt-form", class: "inline-form", novalidate: true, "aria-label": "Open a port of this instance",
        onsubmit: (ev) => { ev.preventDefault(); this.show(); } },
        el("label", { for: "pt-port" }, "Port "),
        el("input", { id: "pt-port", type: "number", min: "1", max: "65535", step: "1", placeholder: "8000",
          size: "7", "aria-describedby": "pt-port-error" }),
        el("button", { type: "submit" }, "Preview link"),
        el("a", { id: "pt-link", hidden: true, target: "_blank", rel: "noopener noreferrer" })),
      el("p", { id: "pt-port-error", class: "field-error", "aria-live": "polite" }),
      el("p", { class: "hint" },
        "The guest's 127.0.0.1:PORT through the server (HTTP and WebSockets, over the agent link). ",
        "For a local port instead: ", el("code", { id: "pt-cli" }, "sandboxctl instance port-forward ID PORT")),
      el("p", { id: "pt-readonly", class: "muted", hidden: true }, "Opening ports needs the operator role."),
    );
  }

  open(instanceId) {
    const operator = this.app.canOperate();
    const form = this.q("#pt-form");
    form.hidden = !operator;
    for (const c of form.elements) c.disabled = !operator;
    this.q("#pt-readonly").hidden = operator;
    if (instanceId !== this.instance) {
      this.instance = instanceId;
      this.q("#pt-link").hidden = true;
      this.q("#pt-port-error").textContent = "";
    }
    this.q("#pt-cli").textContent = `sandboxctl instance port-forward ${instanceId} PORT`;
  }

  show() {
    const raw = this.q("#pt-port").value.trim();
    const port = Number(raw);
    const error = this.q("#pt-port-error");
    const link = this.q("#pt-link");
    if (!/^\d+$/.test(raw) || port < 1 || port > 65535) {
      error.textContent = "A port is a whole number from 1 to 65535.";
      link.hidden = true;
      return;
    }
    error.textContent = "";
    link.href = `/api/v2/admin/instances/${enc(this.instance)}/ports/${port}/`;
    link.textContent = `Open port ${port} of ${this.instance} ↗`;
    link.hidden = false;
  }
}
