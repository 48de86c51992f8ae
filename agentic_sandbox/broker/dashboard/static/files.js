// The instance view's file browser, over /api/v2/admin/instances/{id}/files:
//   list       GET …/files?path=DIR&list   (entries sorted by name; directories shown first)
//   download   a plain link to GET …/files?path=FILE — the browser downloads it with the page's
//              session cookie (a GET needs no CSRF header), streamed to disk, never held here; a
//              directory comes as a .tar. Before following the link the path is stat'ed, so a
//              file gone since the listing is said here (path and reason), not as a broken
//              download.
//   upload     PUT …/files?path=DIR/NAME with the file as the raw body (api.js `upload`, with
//              progress), into the directory shown; replacing an existing file asks first.
//   delete     DELETE …/files?path=… (a directory with everything in it: recursive, asked first).
// Viewers list and download; the upload form and delete buttons are hidden and disabled for
// them (the server refuses them anyway). Every failure is shown with the path it concerns and
// the server's reason (missing, not a directory, permission, too large, …).

import { clearError, showError } from "/static/alerts.js";
import { api, enc, upload } from "/static/api.js";
import { confirmAction, el, fillBody, fmtDateTime } from "/static/dom.js";

/** `dir` + `/` + `name`, for an absolute `dir` ("/" stays "/name"). */
export function joinPath(dir, name) { return dir === "/" ? `/${name}` : `${dir}/${name}`; }

/** The directory holding `path` ("/" for "/" and for "/x"). */
export function parentOf(path) {
  const i = path.lastIndexOf("/");
  return i <= 0 ? "/" : path.slice(0, i);
}

/** A typed path in its plain form: trimmed, repeated and trailing slashes dropped. Anything
 * else (relative, `..`) is the server's to refuse, with its reason. */
export function cleanPath(text) {
  const s = text.trim().replace(/\/{2,}/g, "/");
  return s.length > 1 ? s.replace(/\/+$/, "") : s;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return u === 0 ? `${n} B` : `${v.toFixed(v < 10 ? 1 : 0)} ${units[u]}`;
}

export class FileBrowser {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.instance = null;
    this.path = "/";
    this.items = [];
    this.lastPath = new Map(); // instance → the directory last shown there
    this.transfer = null; // the running upload's AbortController
    this.shown = null; // the instance whose listing the table holds
    this.build();
  }

  q(sel) { return this.root.querySelector(sel); }

  build() {
    this.root.replaceChildren(
      el("h3", {}, "Files"),
      el("form", { id: "fb-go", class: "inline-form", "aria-label": "Go to a directory",
        onsubmit: (ev) => { ev.preventDefault(); this.list(cleanPath(this.q("#fb-path").value)); } },
        el("label", {}, "Path ", el("input", { id: "fb-path", value: "/", autocomplete: "off", spellcheck: "false", size: "40" })),
        el("button", { type: "submit" }, "Go"),
        el("button", { id: "fb-up", type: "button", onclick: () => this.list(parentOf(this.path)) }, "Up"),
        el("button", { id: "fb-refresh", type: "button", onclick: () => this.list(this.path) }, "Refresh")),
      el("nav", { id: "fb-crumbs", class: "crumbs", "aria-label": "Directory path" }),
      el("p", { id: "fb-message", class: "muted", role: "status" }),
      el("p", { id: "fb-error", class: "error", role: "alert" }),
      el("div", { class: "table-wrap fb-wrap" },
        el("table", { id: "fb-table" },
          el("caption", { class: "sr-only" }, "Entries of the directory"),
          el("thead", {}, el("tr", {},
            ...["Name", "Size", "Mode", "Owner", "Modified", ""].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody"))),
      el("form", { id: "fb-upload", class: "inline-form", "aria-label": "Upload a file into this directory",
        onsubmit: (ev) => { ev.preventDefault(); this.upload(); } },
        el("label", {}, "Upload ", el("input", { id: "fb-file", type: "file" })),
        el("button", { type: "submit", class: "primary" }, "Upload here"),
        el("button", { id: "fb-cancel", type: "button", hidden: true, onclick: () => this.transfer && this.transfer.abort() }, "Cancel"),
        el("progress", { id: "fb-progress", max: "1", value: "0", hidden: true, "aria-label": "Upload progress" }),
        el("span", { id: "fb-upload-state", class: "mono", role: "status" })),
      el("p", { id: "fb-readonly", class: "muted", hidden: true },
        "Read-only: your role lists and downloads files; uploading and deleting need the operator role."),
    );
  }

  base() { return `/api/v2/admin/instances/${enc(this.instance)}/files`; }
  url(path, extra = "") { return `${this.base()}?path=${enc(path)}${extra}`; }

  /** Show `instanceId`'s files (from the directory last shown there, else /). */
  open(instanceId) {
    if (this.transfer) this.transfer.abort();
    const operator = this.app.canOperate();
    this.q("#fb-upload").hidden = !operator;
    this.q("#fb-readonly").hidden = operator;
    for (const c of this.q("#fb-upload").elements) c.disabled = !operator;
    this.q("#fb-upload-state").textContent = "";
    delete this.q("#fb-upload-state").dataset.state;
    if (instanceId !== this.instance) {
      this.instance = instanceId;
      this.path = this.lastPath.get(instanceId) || "/";
      fillBody(this.q("#fb-table tbody"), [], "Loading…");
    }
    return this.list(this.path);
  }

  async list(path) {
    const id = this.instance;
    if (!id) return;
    const error = this.q("#fb-error");
    this.q("#fb-path").value = path;
    let listing;
    try {
      listing = await api(this.url(path, "&list"));
    } catch (err) {
      if (id !== this.instance) return;
      showError(error, err, { what: `Could not list ${path}`, retry: () => this.list(path), always: true });
      // nothing of this instance listed yet: say so in the table, not "Loading…"
      if (this.shown !== id) fillBody(this.q("#fb-table tbody"), [], "Not listed: see the message above.");
      return;
    }
    if (id !== this.instance) return;
    clearError(error);
    this.shown = id;
    this.path = path;
    this.lastPath.set(id, path);
    this.root.dataset.path = path;
    this.renderCrumbs(path);
    const dirs = listing.items.filter((i) => i.type === "directory");
    const rest = listing.items.filter((i) => i.type !== "directory");
    this.items = [...dirs, ...rest];
    fillBody(this.q("#fb-table tbody"), this.items.map((i) => this.row(i)), `${path} is empty.`);
    this.q("#fb-message").textContent = listing.truncated
      ? `Only the first ${listing.items.length} entries of ${path} are shown.`
      : `${listing.items.length} entries in ${path}.`;
  }

  renderCrumbs(path) {
    const parts = path.split("/").filter(Boolean);
    const crumbs = [el("button", { type: "button", class: "link", onclick: () => this.list("/") }, "/")];
    let at = "";
    for (const part of parts) {
      at += `/${part}`;
      const target = at;
      crumbs.push(el("button", { type: "button", class: "link", onclick: () => this.list(target) }, part), "/");
    }
    this.q("#fb-crumbs").replaceChildren(...crumbs);
  }

  row(item) {
    const path = joinPath(this.path, item.name);
    const directory = item.type === "directory";
    const name = directory
      ? el("button", { type: "button", class: "link fb-open", "aria-label": `Open directory ${item.name}`, onclick: () => this.list(path) }, `${item.name}/`)
      : el("span", { class: "fb-name" }, item.name, item.link_target ? el("span", { class: "muted" }, ` → ${item.link_target}`) : null);
    const link = el("a", {
      class: "button small fb-download", href: this.url(path), download: directory ? `${item.name}.tar` : item.name,
      "aria-label": `Download ${item.name}${directory ? " as a tar archive" : ""}`,
    }, directory ? "Download .tar" : "Download");
    link.addEventListener("click", (ev) => this.download(ev, link, path));
    const operator = this.app.canOperate();
    const del = operator
      ? el("button", { type: "button", class: "small danger-text fb-delete", "aria-label": `Delete ${item.name}`, onclick: () => this.remove(item, path) }, "Delete…")
      : null;
    return el("tr", { dataset: { name: item.name, type: item.type } },
      el("td", {}, name),
      el("td", { class: "nowrap" }, directory ? "—" : fmtBytes(item.size)),
      el("td", { class: "mono" }, item.mode),
      el("td", {}, `${item.owner}:${item.group}`),
      el("td", { class: "muted nowrap" }, fmtDateTime(new Date(item.mtime * 1000).toISOString())),
      el("td", { class: "actions" }, item.type === "symlink" || item.type === "other" ? null : link, " ", del));
  }

  /** Stat the path first; then let the browser follow the link (and download) for real. */
  async download(ev, link, path) {
    if (link.dataset.checked === "yes") { delete link.dataset.checked; return; }
    ev.preventDefault();
    const error = this.q("#fb-error");
    try {
      await api(this.url(path, "&stat"));
    } catch (err) {
      showError(error, err, { what: `Cannot download ${path}` });
      return;
    }
    clearError(error);
    this.q("#fb-message").textContent = `Downloading ${path}…`;
    link.dataset.checked = "yes";
    link.click();
  }

  async upload() {
    const input = this.q("#fb-file");
    const file = input.files && input.files[0];
    const state = this.q("#fb-upload-state");
    if (!file) { state.textContent = "Choose a file first."; state.dataset.state = "failed"; return; }
    const dir = this.path;
    const path = joinPath(dir, file.name);
    const existing = this.items.find((i) => i.name === file.name);
    if (existing) {
      const ok = await confirmAction({
        title: `Replace ${path}?`,
        message: existing.type === "directory"
          ? `${path} is a directory; the upload will be refused unless you remove it first.`
          : `${path} exists (${fmtBytes(existing.size)}). The upload replaces it (its mode and owner are kept).`,
        confirmLabel: "Upload", danger: true,
      });
      if (!ok) return;
    }
    const bar = this.q("#fb-progress");
    const cancel = this.q("#fb-cancel");
    const submit = this.q("#fb-upload button[type=submit]");
    const controller = new AbortController();
    this.transfer = controller;
    bar.hidden = false;
    bar.max = Math.max(1, file.size);
    bar.value = 0;
    cancel.hidden = false;
    submit.disabled = true;
    state.dataset.state = "running";
    state.textContent = `Uploading ${path}: 0 of ${fmtBytes(file.size)}`;
    const error = this.q("#fb-error");
    clearError(error);
    try {
      const out = await upload(this.url(path), file, {
        signal: controller.signal,
        onProgress: (sent, total) => {
          bar.max = Math.max(1, total);
          bar.value = sent;
          state.textContent = `Uploading ${path}: ${fmtBytes(sent)} of ${fmtBytes(total)}`;
        },
      });
      state.dataset.state = "done";
      state.textContent = `Uploaded ${out.path} (${fmtBytes(out.size)}, SHA-256 ${out.sha256.slice(0, 12)}…).`;
      input.value = "";
      if (this.path === dir) await this.list(dir);
    } catch (err) {
      state.dataset.state = err && err.name === "AbortError" ? "canceled" : "failed";
      if (err && err.name === "AbortError") {
        state.textContent = `Upload of ${path} canceled (nothing is kept of it).`;
      } else {
        state.textContent = `Upload of ${path} failed.`;
        showError(error, err, { what: `Could not upload ${path}` });
      }
    } finally {
      if (this.transfer === controller) this.transfer = null;
      bar.hidden = true;
      cancel.hidden = true;
      submit.disabled = !this.app.canOperate();
    }
  }

  async remove(item, path) {
    const directory = item.type === "directory";
    const ok = await confirmAction({
      title: `Delete ${path}?`,
      message: directory ? `The directory ${path} and everything in it are removed. This cannot be undone.` : `${path} is removed. This cannot be undone.`,
      confirmLabel: "Delete", danger: true,
    });
    if (!ok) return;
    const error = this.q("#fb-error");
    try {
      const out = await api(this.url(path, directory ? "&recursive=true" : ""), { method: "DELETE" });
      clearError(error);
      await this.list(this.path);
      this.q("#fb-message").textContent = `Deleted ${path} (${out.removed} entries).`;
    } catch (err) {
      showError(error, err, { what: `Could not delete ${path}` });
    }
  }
}
