// How a view shows a failed API call — the same for every view: one alert element holding the
// sentence of ApiError.explain() (what happened, in the server's words, and what to do) and,
// where it makes sense, a Retry button. A 401 shows nothing here: the page goes back to sign-in
// (api.js tells dashboard.js), so no view is left with a stale "session expired" of its own.

import { ApiError } from "/static/api.js";
import { el } from "/static/dom.js";

/** The user-facing sentence for any error a call can end with. */
export function explain(err) {
  if (err instanceof ApiError) return err.explain();
  return String((err && err.message) || err || "unknown error");
}

/** Clear an alert (an empty alert is hidden by the CSS). */
export function clearError(box) {
  if (!box) return;
  box.replaceChildren();
  delete box.dataset.kind;
  delete box.dataset.status;
}

/**
 * Show `err` in `box` as "<what>: <explanation>". With `retry`, a Retry button runs it again —
 * always for a load (`always: true`: reading again is harmless), else only when the failure
 * is one that retrying can cure (network, timeout, 429, 503, 5xx).
 */
export function showError(box, err, { what = "", retry = null, always = false } = {}) {
  if (!box) return;
  if (err instanceof ApiError && err.kind === "unauthorized") { clearError(box); return; }
  const text = explain(err);
  box.dataset.kind = (err && err.kind) || "error";
  box.dataset.status = String((err && err.status) ?? "");
  const parts = [el("span", { class: "alert-text" }, what ? `${what}: ${text}` : text)];
  if (retry && (always || (err instanceof ApiError && err.retryable))) {
    const button = el("button", { type: "button", class: "small retry" }, "Retry");
    button.addEventListener("click", async () => {
      button.disabled = true;
      button.textContent = "Retrying…";
      try { await retry(); } finally {
        // the retry re-renders the alert (cleared or a fresh error); if not, the button comes back
        if (button.isConnected) { button.disabled = false; button.textContent = "Retry"; }
      }
    });
    parts.push(" ", button);
  }
  box.replaceChildren(...parts);
}

/**
 * Run a load (`fn` fetches and renders), showing its failure in `box` with a Retry button and
 * clearing `box` once it succeeds. Resolves to fn's value, or undefined when it failed (the
 * failure is shown; nothing is thrown at the caller).
 */
export async function load(box, what, fn) {
  try {
    const value = await fn();
    clearError(box);
    return value;
  } catch (err) {
    showError(box, err, { what, retry: () => load(box, what, fn), always: true });
    if (!(err instanceof ApiError && err.kind === "unauthorized")) console.warn(`${what}:`, err);
    return undefined;
  }
}
