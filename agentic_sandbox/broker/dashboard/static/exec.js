// The instance view's "run command" box: POST /api/v2/admin/instances/{id}/exec and its answer
// (exit code or signal, the budget reason that ended it, stdout and stderr with `truncated`,
// duration). Operators only: for viewers the form is hidden and disabled (the server refuses
// them anyway).
//
// The command is an argv, not a shell line: ONE ARGUMENT PER LINE, each line exactly as typed
// (spaces, quotes and `$` kept; only a line's trailing "\r" goes), trailing empty lines dropped.
// No quoting rules to learn and nothing split where the user did not mean it. For a shell, name
// one: `bash`, `-c`, `echo $HOME | wc -c` on three lines.

import { clearError, showError } from "/static/alerts.js";
import { api, enc } from "/static/api.js";
import { el } from "/static/dom.js";

const SLACK_MS = 30000; // the HTTP call may take this much longer than the command's own timeout

/** The argv of the box's text: one argument per line (see above). */
export function argvOf(text) {
  const lines = text.split("\n").map((l) => l.replace(/\r$/, ""));
  while (lines.length && lines[lines.length - 1] === "") lines.pop();
  return lines;
}

export class RunBox {
  constructor(app, root) {
    this.app = app;
    this.root = root;
    this.instance = null;
    this.running = null;
    this.build();
  }

  q(sel) { return this.root.querySelector(sel); }

  build() {
    this.root.replaceChildren(
      el("h3", {}, "Run command"),
      el("form", { id: "ex-form", "aria-label": "Run a command on this instance",
        onsubmit: (ev) => { ev.preventDefault(); this.run(); } },
        el("div", { class: "field" },
          el("label", { for: "ex-argv" }, "Command (one argument per line)"),
          el("textarea", { id: "ex-argv", rows: "3", spellcheck: "false", placeholder: "bash\n-c\necho hello | tr a-z A-Z",
            "aria-describedby": "ex-argv-hint ex-argv-error" }),
          el("p", { id: "ex-argv-hint", class: "hint" },
            "Each line is one argument, exactly as typed (no shell quoting); no shell unless you name one."),
          el("p", { id: "ex-argv-error", class: "field-error", "aria-live": "polite" })),
        el("div", { class: "inline-form" },
          el("label", {}, "Timeout (s) ", el("input", { id: "ex-timeout", type: "number", min: "1", max: "3600", step: "any", value: "30", size: "6" })),
          el("label", {}, "Working directory ", el("input", { id: "ex-cwd", placeholder: "the agent's default", autocomplete: "off", spellcheck: "false" })),
          el("button", { type: "submit", class: "primary" }, "Run"))),
      el("p", { id: "ex-readonly", class: "muted", hidden: true }, "Running commands needs the operator role."),
      el("p", { id: "ex-error", class: "error", role: "alert" }),
      el("div", { id: "ex-result", hidden: true },
        el("p", { id: "ex-status", role: "status" }),
        el("h4", {}, "stdout ", el("span", { id: "ex-stdout-note", class: "muted" })),
        el("pre", { id: "ex-stdout", class: "output", "aria-label": "Standard output" }),
        el("h4", {}, "stderr ", el("span", { id: "ex-stderr-note", class: "muted" })),
        el("pre", { id: "ex-stderr", class: "output", "aria-label": "Standard error" })),
    );
  }

  open(instanceId) {
    const operator = this.app.canOperate();
    const form = this.q("#ex-form");
    form.hidden = !operator;
    for (const c of form.elements) c.disabled = !operator || this.running !== null;
    this.q("#ex-readonly").hidden = operator;
    if (instanceId !== this.instance) {
      this.instance = instanceId;
      this.q("#ex-result").hidden = true;
      clearError(this.q("#ex-error"));
    }
  }

  async run() {
    const id = this.instance;
    const argv = argvOf(this.q("#ex-argv").value);
    const fieldError = this.q("#ex-argv-error");
    fieldError.textContent = "";
    if (!argv.length || !argv[0]) { fieldError.textContent = "Name a program on the first line."; return; }
    const body = { argv };
    const timeout = Number(this.q("#ex-timeout").value);
    if (this.q("#ex-timeout").value.trim() && timeout > 0) body.budget = { timeout_seconds: timeout };
    const cwd = this.q("#ex-cwd").value.trim();
    if (cwd) body.cwd = cwd;
    const error = this.q("#ex-error");
    const form = this.q("#ex-form");
    clearError(error);
    for (const c of form.elements) c.disabled = true;
    this.running = id;
    this.q("#ex-status").textContent = `Running ${argv[0]}…`;
    this.q("#ex-result").dataset.state = "running";
    try {
      const out = await api(`/api/v2/admin/instances/${enc(id)}/exec`, {
        method: "POST", body, timeoutMs: ((body.budget ? timeout : 300) * 1000) + SLACK_MS,
      });
      if (id === this.instance) this.render(out);
    } catch (err) {
      if (id !== this.instance) return;
      this.q("#ex-result").hidden = true;
      const field = (err.errors || []).find((e) => /^body\.(argv|cwd|budget)/.test(e.field || ""));
      if (field && field.field.startsWith("body.argv")) fieldError.textContent = `${field.field.replace(/^body\./, "")}: ${field.message}`;
      showError(error, err, { what: `Could not run ${argv[0]}` });
    } finally {
      this.running = null;
      for (const c of form.elements) c.disabled = !this.app.canOperate();
    }
  }

  render(out) {
    const box = this.q("#ex-result");
    box.hidden = false;
    box.dataset.state = "done";
    box.dataset.exit = out.exit_code === null ? "" : String(out.exit_code);
    box.dataset.signal = out.signal || "";
    box.dataset.reason = out.reason || "";
    const how = out.exit_code !== null ? `exit code ${out.exit_code}` : `killed by signal ${out.signal}`;
    const reason = out.reason ? ` — ended by its budget: ${out.reason}` : "";
    const status = this.q("#ex-status");
    status.textContent = `${how}${reason} · ${out.duration_seconds.toFixed(2)} s · CPU ${out.usage.cpu_seconds.toFixed(2)} s · ${out.enforcement}`;
    status.className = out.exit_code === 0 && !out.reason ? "ok-text" : "error";
    for (const name of ["stdout", "stderr"]) {
      const stream = out[name];
      const pre = this.q(`#ex-${name}`);
      pre.textContent = out.encoding === "base64" ? `(base64) ${stream.data}` : stream.data;
      pre.dataset.truncated = String(stream.truncated);
      this.q(`#ex-${name}-note`).textContent = `${stream.bytes} bytes${stream.truncated ? " — truncated: only the start is shown" : ""}`;
    }
  }
}
