// Small DOM helpers shared by the dashboard's views (no framework).

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

/** el("button", {class: "x", onclick: fn, dataset: {id}}, "text", childNode, …) */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else if (value === true) node.setAttribute(key, "");
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function debounce(fn, ms) {
  let timer = null;
  const run = (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => { timer = null; fn(...args); }, ms);
  };
  run.now = (...args) => { clearTimeout(timer); timer = null; return fn(...args); };
  return run;
}

const STATE_CLASS = {
  running: "ok", connected: "ok", succeeded: "ok", completed: "ok", ready: "ok", working: "ok",
  paused: "warn", stale: "warn", "input-required": "warn", "auth-required": "warn",
  provisioning: "info", starting: "info", submitted: "info", pending: "info", killing: "info",
  blocked: "warn",
  shutoff: "off", exited: "off", disconnected: "off", absent: "off", canceled: "off", deleted: "off",
  crashed: "bad", failed: "bad", lost: "bad", rejected: "bad", unknown: "off",
  reachable: "ok", unreachable: "bad", draining: "warn",
};

/** A state badge: <span class="badge badge-ok" data-state="running">running</span> */
export function badge(state, label) {
  const s = state || "unknown";
  return el("span", { class: `badge badge-${STATE_CLASS[s] || "off"}`, dataset: { state: s } }, label || s);
}

export function shortId(id) { return id ? String(id).slice(0, 8) : ""; }

export function fmtTime(value) {
  if (!value) return "";
  const d = new Date(value);
  if (Number.isNaN(d.getTime())) return String(value);
  return d.toLocaleTimeString([], { hour12: false });
}

export function fmtDateTime(value) {
  if (!value) return "";
  const d = new Date(value);
  if (Number.isNaN(d.getTime())) return String(value);
  return `${d.toLocaleDateString()} ${d.toLocaleTimeString([], { hour12: false })}`;
}

export function ago(value) {
  if (!value) return "";
  const secs = Math.max(0, (Date.now() - new Date(value).getTime()) / 1000);
  if (secs < 60) return `${Math.round(secs)}s ago`;
  if (secs < 3600) return `${Math.round(secs / 60)}m ago`;
  if (secs < 86400) return `${Math.round(secs / 3600)}h ago`;
  return `${Math.round(secs / 86400)}d ago`;
}

export function fmtDuration(seconds) {
  const s = Math.max(0, Math.floor(seconds || 0));
  const m = Math.floor(s / 60);
  return `${m}:${String(s % 60).padStart(2, "0")}`;
}

export function fmtMiB(mib) {
  if (mib === null || mib === undefined) return "";
  return mib >= 1024 && mib % 1024 === 0 ? `${mib / 1024} GiB` : `${mib} MiB`;
}

/** Replace a <tbody>'s rows, or show an empty-state row spanning the table. */
export function fillBody(tbody, rows, emptyText) {
  if (rows.length) { tbody.replaceChildren(...rows); return; }
  const cols = tbody.closest("table").querySelectorAll("thead th").length || 1;
  tbody.replaceChildren(el("tr", { class: "empty" }, el("td", { colspan: cols, class: "muted" }, emptyText)));
}

/** Open a native modal dialog and put the focus on its first field (or a given element). */
export function openDialog(dialog, focus) {
  if (!dialog.open) dialog.showModal();
  const target = focus || dialog.querySelector("[autofocus], input:not([type=hidden]):not([disabled]), select, textarea, button");
  if (target) target.focus();
}

/** Ask for a confirmation in the shared confirm dialog. Resolves true or false. */
export function confirmAction({ title, message, confirmLabel = "Confirm", danger = false }) {
  const dialog = $("#confirm-dialog");
  $("#confirm-title").textContent = title;
  $("#confirm-message").textContent = message;
  const ok = $("#confirm-ok");
  ok.textContent = confirmLabel;
  ok.classList.toggle("danger", danger);
  return new Promise((resolve) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      resolve(dialog.returnValue === "confirm");
    };
    dialog.returnValue = "";
    dialog.addEventListener("close", done);
    openDialog(dialog, $("#confirm-cancel"));
  });
}
