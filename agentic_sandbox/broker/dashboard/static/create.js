// The create dialog (POST /api/v2/admin/instances → 202 + an operation) and operation progress
// (GET /api/v2/admin/operations/{id}, refreshed on `operation.*` events and by a slow poll).
//
// Errors are RFC 7807 problems: `errors[].field` ("body.image", "body.resources.cpus", …) puts
// the message next to that field; every other failure (503 fleet disabled, 404, 409, 429, a
// 5xx, no network) goes in the dialog's banner in the shared wording of alerts.js, with a
// Retry button when retrying can help. The form keeps what was typed either way. A failed
// operation shows the stage it failed at and the server's cause, and offers to change and retry.

import { clearError, explain, load, showError } from "/static/alerts.js";
import { api, enc } from "/static/api.js";
import { $, el, fmtMiB, openDialog } from "/static/dom.js";

const TERMINAL = ["succeeded", "failed", "canceled"];

// problem field → the form control it is about
const FIELDS = {
  id: "create-id",
  image: "create-image",
  loadout: "create-loadout",
  loadout_spec: "create-loadout",
  "resources.cpus": "create-cpus",
  "resources.memory_mib": "create-memory",
  "resources.disk_gib": "create-disk",
  resources: "create-cpus",
  network: "create-network",
  host: "create-host",
  host_labels: "create-host",
  from_snapshot: "create-snapshot",
  from_pool: "create-source-pool",
  ssh_keys: "create-ssh-keys",
  start: "create-start",
  wait_ready: "create-wait",
};

function controlFor(field) {
  let key = String(field || "").replace(/^body\.?/, "");
  while (key) {
    if (FIELDS[key]) return FIELDS[key];
    if (/^ssh_keys\.\d+$/.test(key)) return FIELDS.ssh_keys;
    key = key.includes(".") ? key.slice(0, key.lastIndexOf(".")) : "";
  }
  return null;
}

/** An image upload's stage facts: "12.5 / 300.0 MiB to host far". */
function uploadText(s) {
  const mib = (n) => (n / 1048576).toFixed(1);
  return `${mib(s.bytes_done || 0)} / ${mib(s.bytes_total)} MiB to host ${s.host || "?"}`;
}

export class CreateDialog {
  constructor(app) {
    this.app = app;
    this.dialog = $("#create-dialog");
    this.form = $("#create-form");
    this.loadouts = [];
    this.op = null;
    this.pollTimer = null;
    $("#create-open").addEventListener("click", () => this.open());
    $("#create-cancel").addEventListener("click", () => this.dialog.close());
    $("#op-close").addEventListener("click", () => this.dialog.close());
    $("#op-cancel").addEventListener("click", () => this.cancelOperation());
    $("#op-again").addEventListener("click", () => this.showForm());
    this.form.addEventListener("submit", (ev) => { ev.preventDefault(); this.submit(); });
    $("#create-loadout").addEventListener("change", () => this.loadoutChanged());
    for (const radio of this.form.querySelectorAll("input[name=source]")) radio.addEventListener("change", () => this.sourceChanged());
    for (const ctl of this.form.querySelectorAll("input, select, textarea")) {
      ctl.addEventListener("input", () => this.clearFieldError(ctl.id));
    }
    this.dialog.addEventListener("close", () => { clearTimeout(this.pollTimer); this.app.refresh.instances(); });
  }

  async open({ fromSnapshot } = {}) {
    this.showForm();
    this.clearErrors();
    if (fromSnapshot) {
      this.form.querySelector("input[name=source][value=snapshot]").checked = true;
      $("#create-snapshot").value = fromSnapshot;
    }
    this.sourceChanged();
    openDialog(this.dialog, $("#create-id"));
    await this.loadChoices();
  }

  async loadChoices() {
    const [images, loadouts, hosts] = await Promise.allSettled([
      api("/api/v2/admin/images"), api("/api/v2/admin/loadouts"), api("/api/v2/admin/hosts"),
    ]);
    const notice = $("#create-fleet-notice");
    const hostSelect = $("#create-host");
    const chosenHost = hostSelect.value;
    hostSelect.replaceChildren(el("option", { value: "" }, "any (placed by the fleet)"));
    if (hosts.status === "fulfilled") {
      notice.hidden = true;
      for (const h of hosts.value.items) {
        hostSelect.append(el("option", { value: h.name, disabled: h.state !== "reachable" },
          `${h.name} — ${h.state}, ${h.cpus - h.committed_vcpus}/${h.cpus} vCPU and ${fmtMiB(h.free_memory_mib)} free`));
      }
      if (hosts.value.items.some((h) => h.name === chosenHost)) hostSelect.value = chosenHost;
    } else {
      const err = hosts.reason;
      notice.textContent = err.status === 503
        ? `The fleet is not available: ${err.detail}. A create will be refused until it is.`
        : `Hosts unavailable: ${explain(err)}`;
      notice.hidden = false;
    }
    if (images.status === "fulfilled") {
      $("#create-images").replaceChildren(...images.value.items.map((i) =>
        el("option", { value: i.name }, i.recipe ? `${i.kind} · recipe ${i.recipe}` : i.kind)));
      $("#create-image-hint").textContent = images.value.items.length
        ? `${images.value.items.length} image(s) in the cache; a recipe name also works. Empty: the server's default recipe.`
        : "No image in the cache yet. Type a recipe name, or leave empty for the server's default recipe.";
    } else {
      $("#create-image-hint").textContent = `Images unavailable: ${explain(images.reason)}`;
    }
    const select = $("#create-loadout");
    if (loadouts.status === "fulfilled") {
      this.loadouts = loadouts.value.items;
      const current = select.value || "minimal";
      select.replaceChildren(...this.loadouts.map((l) => el("option", { value: l.name }, l.name)));
      if (this.loadouts.some((l) => l.name === current)) select.value = current;
    } else {
      $("#create-loadout-desc").textContent = `Loadouts unavailable: ${explain(loadouts.reason)}`;
    }
    this.loadoutChanged();
    this.loadSnapshotChoices();
  }

  async loadSnapshotChoices() {
    // Memory snapshots of the instances this user can see (for "from a snapshot").
    const list = $("#create-snapshots");
    const instances = (this.app.instances && this.app.instances.items) || [];
    const options = [];
    await Promise.all(instances.slice(0, 50).map(async (inst) => {
      try {
        const snaps = await api(`/api/v2/admin/instances/${enc(inst.id)}/snapshots`);
        for (const s of snaps.items) if (s.kind === "memory") options.push(`${inst.id}/${s.name}`);
      } catch (_) { /* not every instance has a VM */ }
    }));
    list.replaceChildren(...options.sort().map((v) => el("option", { value: v })));
  }

  loadoutChanged() {
    const lo = this.loadouts.find((l) => l.name === $("#create-loadout").value);
    const desc = $("#create-loadout-desc");
    if (!lo) return;
    desc.textContent = `${lo.description} Defaults: ${lo.resources.cpus} vCPU, ${fmtMiB(lo.resources.memory_mib)}, ${lo.resources.disk_gib} GiB disk, network ${lo.network}.`;
    $("#create-cpus").placeholder = String(lo.resources.cpus);
    $("#create-memory").placeholder = String(lo.resources.memory_mib);
    $("#create-disk").placeholder = String(lo.resources.disk_gib);
    $("#create-network").options[0].textContent = `loadout default (${lo.network})`;
  }

  sourceChanged() {
    const source = this.form.querySelector("input[name=source]:checked").value;
    $("#create-image-row").hidden = source === "snapshot";
    $("#create-snapshot-row").hidden = source !== "snapshot";
  }

  body() {
    const num = (id) => { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); };
    const source = this.form.querySelector("input[name=source]:checked").value;
    const body = { id: $("#create-id").value.trim(), loadout: $("#create-loadout").value || "minimal" };
    const image = $("#create-image").value.trim();
    if (source !== "snapshot" && image) body.image = image;
    if (source === "snapshot") body.from_snapshot = $("#create-snapshot").value.trim();
    if (source === "pool") body.from_pool = true;
    const resources = { cpus: num("#create-cpus"), memory_mib: num("#create-memory"), disk_gib: num("#create-disk") };
    if (Object.values(resources).some((v) => v !== undefined)) body.resources = resources;
    const network = $("#create-network").value;
    if (network) body.network = network;
    const host = $("#create-host").value;
    if (host) body.host = host;
    const keys = $("#create-ssh-keys").value.split("\n").map((k) => k.trim()).filter(Boolean);
    if (keys.length) body.ssh_keys = keys;
    body.start = $("#create-start").checked;
    body.wait_ready = $("#create-wait").checked;
    return body;
  }

  clearFieldError(controlId) {
    const ctl = document.getElementById(controlId);
    const out = document.getElementById(`${controlId}-error`);
    if (ctl) ctl.removeAttribute("aria-invalid");
    if (out) out.textContent = "";
  }

  clearErrors() {
    clearError($("#create-error"));
    for (const out of this.form.querySelectorAll(".field-error")) out.textContent = "";
    for (const ctl of this.form.querySelectorAll("[aria-invalid]")) ctl.removeAttribute("aria-invalid");
  }

  showProblem(err) {
    const fieldErrors = [...(err.errors || [])];
    if (!fieldErrors.length && err.status === 422) {
      // some problems name the field only in `detail` ("body.from_snapshot: …")
      const m = /^(body\.[\w.]+):\s*(.*)$/s.exec(err.detail || "");
      if (m) fieldErrors.push({ field: m[1], message: m[2] });
    }
    let first = null;
    const unplaced = [];
    for (const fe of fieldErrors) {
      const id = controlFor(fe.field);
      const out = id && document.getElementById(`${id}-error`);
      if (!out) { unplaced.push(`${fe.field}: ${fe.message}`); continue; }
      const ctl = document.getElementById(id);
      ctl.setAttribute("aria-invalid", "true");
      out.textContent = out.textContent ? `${out.textContent}; ${fe.message}` : fe.message;
      first = first || ctl;
    }
    const banner = $("#create-error");
    if (fieldErrors.length && !unplaced.length) {
      banner.textContent = fieldErrors.length > 1
        ? `Please fix the ${fieldErrors.length} highlighted fields.`
        : `Please fix the highlighted field. (${err.detail})`;
      banner.dataset.status = String(err.status || "");
    } else {
      showError(banner, err, { what: unplaced.length ? unplaced.join("; ") : "", retry: () => this.submit() });
    }
    (first || banner).focus?.();
  }

  async submit() {
    if (this.submitting) return;
    this.submitting = true;
    this.clearErrors();
    const submit = $("#create-submit");
    submit.disabled = true;
    submit.textContent = "Creating…";
    try {
      const op = await api("/api/v2/admin/instances", { method: "POST", body: this.body() });
      this.track(op);
      this.app.refresh.instances();
      this.app.refresh.operations();
    } catch (err) {
      this.showProblem(err);
    } finally {
      this.submitting = false;
      submit.disabled = false;
      submit.textContent = "Create";
    }
  }

  // ---- operation progress -------------------------------------------------------------------
  showForm() {
    clearTimeout(this.pollTimer);
    this.op = null;
    this.form.hidden = false;
    $("#op-progress").hidden = true;
  }

  track(op) {
    this.form.hidden = true;
    $("#op-progress").hidden = false;
    $("#op-subject").textContent = op.subject_id;
    this.renderOperation(op);
    $("#op-title").focus();
  }

  onEvent(ev) {
    if (this.op && ev.data && ev.data.operation_id === this.op.id) this.refreshOperation();
  }

  async refreshOperation() {
    if (!this.op) return;
    const op = this.op;
    try {
      this.renderOperation(await api(`/api/v2/admin/operations/${enc(op.id)}`));
    } catch (err) {
      if (this.op !== op) return;
      // keep following it: the next poll (or Retry) reads it again
      showError($("#op-error"), err, { what: "Could not read the operation", retry: () => this.refreshOperation(), always: true });
      clearTimeout(this.pollTimer);
      if (this.dialog.open && !TERMINAL.includes(op.state)) this.pollTimer = setTimeout(() => this.refreshOperation(), 3000);
    }
  }

  renderOperation(op) {
    // answers can arrive out of order: never go back to an older state of the same operation
    if (this.op && this.op.id === op.id && (TERMINAL.includes(this.op.state) ||
        new Date(op.updated_at) < new Date(this.op.updated_at)) && !TERMINAL.includes(op.state)) return;
    const done = TERMINAL.includes(op.state);
    const box = $("#op-progress");
    box.dataset.state = op.state;
    $("#op-state").textContent = op.state;
    $("#op-state").dataset.state = op.state;
    // a failed operation names the stage it failed at (which may not have reported itself)
    const failedAt = op.state === "failed" && op.error ? op.error.stage : null;
    $("#op-stage").textContent = failedAt || op.stage || "—";
    const bar = $("#op-bar");
    // never let the bar run backwards while an operation runs (a stage may be reported twice)
    const before = this.op && this.op.id === op.id ? this.shownProgress || 0 : 0;
    this.shownProgress = op.state === "succeeded" ? 1 : Math.max(before, op.progress || 0);
    bar.value = this.shownProgress;
    bar.setAttribute("aria-valuetext", `${Math.round(bar.value * 100)}% · ${op.stage || op.state}`);
    $("#op-percent").textContent = `${Math.round(bar.value * 100)}%`;
    this.op = op;
    const reported = op.stages || [];
    const shown = failedAt && !reported.some((s) => s.name === failedAt) ? [...reported, { name: failedAt, seconds: null }] : reported;
    const stages = shown.map((s) => {
      const finished = s.seconds !== null && s.seconds !== undefined;
      const failed = failedAt !== null && s.name === failedAt;
      return el("li", {
        dataset: { stage: s.name, done: String(finished), failed: failed ? "true" : null },
        class: failed ? "stage-failed" : finished ? "stage-done" : done ? "stage-stopped" : "stage-running",
      }, el("span", { class: "stage-name" }, s.name),
      typeof s.bytes_total === "number"
        ? el("span", { class: "stage-bytes muted" }, ` ${uploadText(s)}`) : null,
      el("span", { class: "stage-time" }, failed ? "failed" : finished ? `${s.seconds.toFixed(2)} s` : done ? "stopped" : "running…"));
    });
    $("#op-stages").replaceChildren(...stages);
    const opError = $("#op-error");
    clearError(opError);
    if (op.error) {
      opError.textContent = `${op.state === "canceled" ? "Canceled" : "Failed"} at stage ${op.error.stage}: ${op.error.cause}`;
      opError.dataset.kind = "operation";
    }
    const res = op.result || {};
    $("#op-result").textContent = op.state === "succeeded"
      ? `Instance ${op.subject_id} created${res.host ? ` on host ${res.host}` : ""}${typeof res.seconds === "number" ? ` in ${res.seconds.toFixed(1)} s` : ""}.`
      : "";
    $("#op-cancel").hidden = done;
    $("#op-again").hidden = !done;
    $("#op-again").textContent = op.state === "succeeded" ? "Create another" : "Change and retry";
    clearTimeout(this.pollTimer);
    if (!done && this.dialog.open) this.pollTimer = setTimeout(() => this.refreshOperation(), 1500);
    if (done) { this.app.refresh.instances(); this.app.refresh.operations(); }
  }

  async cancelOperation() {
    if (!this.op) return;
    try {
      this.renderOperation(await api(`/api/v2/admin/operations/${enc(this.op.id)}/cancel`, { method: "POST" }));
    } catch (err) {
      showError($("#op-error"), err, { what: "Cancel failed", retry: () => this.cancelOperation() });
    }
  }
}

/** The recent-operations list under the instance table (a failure: shown, with Retry). */
export function loadOperations() {
  return load($("#operations-error"), "Could not load operations", () => fetchOperations().catch((err) => {
    $("#ops-running").textContent = "(not loaded)";
    throw err;
  }));
}

async function fetchOperations() {
  const list = $("#operations");
  const ops = await api("/api/v2/admin/operations?limit=8");
  const running = ops.items.filter((o) => !TERMINAL.includes(o.state)).length;
  $("#ops-running").textContent = running ? `(${running} running)` : `(${ops.items.length})`;
  if (!ops.items.length) { list.replaceChildren(el("li", { class: "muted" }, "No operations yet.")); return; }
  list.replaceChildren(...ops.items.map((o) => el("li", { dataset: { operation: o.id, state: o.state } },
    el("span", { class: "op-kind" }, `${o.kind} ${o.subject_id}`), " ",
    el("progress", { max: "1", value: String(o.state === "succeeded" ? 1 : o.progress || 0), "aria-label": `${o.kind} ${o.subject_id} progress` }), " ",
    el("span", { class: `op-state op-${o.state}` }, o.state === "running" ? `${o.stage || "running"}` : o.state),
    o.error ? el("span", { class: "muted" }, ` — ${o.error.stage}: ${o.error.cause}`) : null)));
}
