// The dashboard's HTTP client: the one function every API call goes through. Same-origin fetch
// with the HttpOnly session cookie, the CSRF header on every mutating request, a deadline on
// every request, and every way a call can fail turned into one ApiError with a `kind`:
//
//   network      the server could not be reached (connection refused, reset, offline)
//   timeout      no answer within the deadline
//   unauthorized 401: the session expired or was revoked (the page returns to sign-in)
//   forbidden    403        not-found 404        conflict 409/412
//   invalid      400/422 (field errors in `errors`)
//   rate-limited 429 (`retryAfter` seconds from Retry-After)
//   unavailable  503 (the fleet or a dependency is not ready; `retryAfter` when sent); also a
//                follower's 307, after which the page moves to the leader (followLeader())
//   server       any other 5xx (`requestId` names the request in the server's log)
//
// `err.explain()` is the sentence a view shows; `err.retryable` says whether offering "Retry"
// makes sense. Views render it with showError() (/static/alerts.js), never their own wording.
//
// The operator token is only ever sent once, in the login request body; it is never stored
// (no localStorage, no URL). The CSRF token lives in this module's memory for the page's life.

let csrfToken = null;
const unauthorizedListeners = [];

export const TIMEOUT_MS = 30000;

const KIND_OF_STATUS = {
  400: "invalid", 401: "unauthorized", 403: "forbidden", 404: "not-found", 409: "conflict",
  412: "conflict", 422: "invalid", 429: "rate-limited", 503: "unavailable",
};
const RETRYABLE = new Set(["network", "timeout", "rate-limited", "unavailable", "server"]);

function kindOf(status) {
  if (KIND_OF_STATUS[status]) return KIND_OF_STATUS[status];
  return status >= 500 ? "server" : "client";
}

function seconds(header) {
  if (!header) return null;
  if (/^\d+$/.test(header.trim())) return Number(header.trim());
  const at = Date.parse(header); // Retry-After may be an HTTP date
  return Number.isNaN(at) ? null : Math.max(1, Math.ceil((at - Date.now()) / 1000));
}

export class ApiError extends Error {
  constructor(status, problem, { kind, retryAfter = null, requestId = null } = {}) {
    const detail = (problem && (problem.detail || problem.title)) || `HTTP ${status}`;
    super(detail);
    this.name = "ApiError";
    this.status = status;
    this.problem = problem || {};
    this.detail = detail;
    this.kind = kind || kindOf(status);
    this.code = this.problem.code || null;
    this.errors = Array.isArray(this.problem.errors) ? this.problem.errors : [];
    this.retryAfter = retryAfter;
    this.requestId = this.problem.request_id || requestId || null;
    this.retryable = RETRYABLE.has(this.kind);
  }

  // "503 Service Unavailable: the fleet is disabled …" (status and the server's words)
  describe() {
    if (this.kind === "network" || this.kind === "timeout") return this.detail;
    const title = this.problem.title ? ` ${this.problem.title}` : "";
    return `${this.status}${title}: ${this.detail}`;
  }

  // The sentence shown to the user: what happened, in the server's words, and what to do.
  explain() {
    const wait = this.retryAfter ? ` Retry in ${this.retryAfter} s.` : " Retry in a moment.";
    switch (this.kind) {
      case "network":
        return "The server cannot be reached (network error). Check the connection and that the server runs, then retry.";
      case "timeout":
        return `The server did not answer within ${Math.round(TIMEOUT_MS / 1000)} s. Retry in a moment.`;
      case "unauthorized":
        return "Your session has expired or was revoked: sign in again.";
      case "rate-limited":
        return `Refused for now (429 Too Many Requests): ${this.detail}.${wait}`;
      case "unavailable":
        return `Not available right now (503): ${this.detail}.${wait}`;
      case "server":
        return `The server failed (${this.describe()}). Retry; if it keeps failing, look in the server's log`
          + (this.requestId ? ` for request ${this.requestId}.` : ".");
      default:
        return this.describe();
    }
  }
}

export function setCsrf(token) { csrfToken = token || null; }

export function onUnauthorized(fn) { unauthorizedListeners.push(fn); }

async function problemOf(resp) {
  const type = resp.headers.get("Content-Type") || "";
  if (type.includes("json")) {
    try { return await resp.json(); } catch (_) { /* fall through */ }
  }
  // not a problem document (a proxy's HTML error page, an empty body): status and reason only
  return { title: resp.statusText, detail: resp.statusText || `HTTP ${resp.status}` };
}

/** Call the API. `body` (an object) is sent as JSON. Resolves to parsed JSON, text or null —
 * or, with `accept: "stream"`, to the Response itself once its headers are in (the deadline
 * covers only that; the caller's `signal` still ends the body). Rejects with an ApiError (an
 * AbortError only when the caller's own `signal` aborted). */
export async function api(path, { method = "GET", body, signal, accept = "json", headers: extra = {}, quiet401 = false, timeoutMs = TIMEOUT_MS } = {}) {
  const headers = { ...extra };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && method !== "HEAD" && csrfToken) headers["X-CSRF-Token"] = csrfToken;
  const deadline = new AbortController();
  const timer = setTimeout(() => deadline.abort(), timeoutMs);
  const onAbort = () => deadline.abort();
  if (signal) signal.addEventListener("abort", onAbort, { once: true });
  if (signal && signal.aborted) deadline.abort();
  let streaming = false;
  try {
    let resp;
    try {
      resp = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "same-origin",
        cache: "no-store",
        redirect: "manual", // a follower's 307 to the leader: the page moves, not the call
        signal: deadline.signal,
      });
    } catch (err) {
      if (signal && signal.aborted) throw err; // the caller gave up: not an error to show
      const kind = deadline.signal.aborted ? "timeout" : "network";
      throw new ApiError(0, { title: kind, detail: kind === "timeout" ? `no answer within ${Math.round(timeoutMs / 1000)} s` : "the server cannot be reached" }, { kind });
    }
    if (resp.type === "opaqueredirect") throw await followLeader();
    if (!resp.ok) {
      const err = new ApiError(resp.status, await problemOf(resp), {
        retryAfter: seconds(resp.headers.get("Retry-After")),
        requestId: resp.headers.get("X-Request-Id"),
      });
      if (resp.status === 401 && !quiet401) unauthorizedListeners.forEach((fn) => fn(err));
      throw err;
    }
    if (resp.status === 204) return null;
    if (accept === "stream") { streaming = true; return resp; }
    try {
      if (accept === "text") return await resp.text();
      const type = resp.headers.get("Content-Type") || "";
      return type.includes("json") ? await resp.json() : await resp.text();
    } catch (err) {
      if (signal && signal.aborted) throw err;
      const kind = deadline.signal.aborted ? "timeout" : err instanceof SyntaxError ? "server" : "network";
      throw new ApiError(kind === "server" ? 502 : 0, { title: kind, detail: kind === "server" ? "the answer is not valid JSON" : "the answer was cut off" }, { kind });
    }
  } finally {
    clearTimeout(timer);
    if (signal && !streaming) signal.removeEventListener("abort", onAbort);
  }
}

/** This node follows another (several control hosts): ask /readyz who leads and open the same
 * view on the leader's dashboard (the same host keeps the sign-in cookie; another host asks
 * again). Resolves to the ApiError the interrupted call rejects with. */
export async function followLeader() {
  let doc = null;
  try {
    const resp = await fetch("/readyz", { credentials: "same-origin", cache: "no-store" });
    doc = await resp.json();
  } catch (_) { /* below: nobody named */ }
  const leader = doc && doc.leader;
  if (leader && leader.url && new URL(leader.url).origin !== location.origin) {
    location.assign(leader.url.replace(/\/$/, "") + location.pathname + location.search + location.hash);
    return new ApiError(307, { title: "moved", detail: `this node follows ${leader.node}; opening its dashboard at ${leader.url}` }, { kind: "unavailable" });
  }
  return new ApiError(503, { title: "no leader", detail: "no control host leads right now (an election is under way)" }, { kind: "unavailable", retryAfter: 1 });
}

/** Send `blob` as the raw body of a PUT (a file upload) and resolve to the parsed JSON answer.
 * XMLHttpRequest, not fetch: only it reports upload progress (`onProgress(sent, total)`). The
 * same cookie, CSRF header and ApiError as api(); the body is always sent as
 * application/octet-stream (a browser would label a .tar file application/x-tar, which the files
 * API unpacks as a directory). No overall deadline — a big file takes as long as it takes —
 * the caller's `signal` cancels (rejecting with an AbortError). */
export function upload(path, blob, { method = "PUT", signal, onProgress } = {}) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open(method, path);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    if (csrfToken) xhr.setRequestHeader("X-CSRF-Token", csrfToken);
    xhr.upload.onprogress = (ev) => { if (onProgress) onProgress(ev.loaded, ev.lengthComputable ? ev.total : blob.size); };
    xhr.onload = () => {
      const type = xhr.getResponseHeader("Content-Type") || "";
      let doc = null;
      if (type.includes("json")) { try { doc = JSON.parse(xhr.responseText); } catch (_) { /* below */ } }
      if (xhr.status >= 200 && xhr.status < 300) { resolve(doc); return; }
      const err = new ApiError(xhr.status, doc || { title: xhr.statusText, detail: xhr.statusText || `HTTP ${xhr.status}` }, {
        retryAfter: seconds(xhr.getResponseHeader("Retry-After")),
        requestId: xhr.getResponseHeader("X-Request-Id"),
      });
      if (xhr.status === 401) unauthorizedListeners.forEach((fn) => fn(err));
      reject(err);
    };
    xhr.onerror = () => reject(new ApiError(0, {
      title: "network",
      detail: "the upload was cut off: the server cannot be reached, or it closed the connection before the body was sent (a refusal, e.g. over its upload size limit)",
    }, { kind: "network" }));
    xhr.onabort = () => reject(new DOMException("the upload was canceled", "AbortError"));
    if (signal) {
      if (signal.aborted) { reject(new DOMException("the upload was canceled", "AbortError")); return; }
      signal.addEventListener("abort", () => xhr.abort(), { once: true });
    }
    xhr.send(blob);
  });
}

export const enc = encodeURIComponent;
