// The dashboard's HTTP client: same-origin fetch with the HttpOnly session cookie, the CSRF
// header on every mutating request, and RFC 7807 problems turned into ApiError.
//
// The operator token is only ever sent once, in the login request body; it is never stored
// (no localStorage, no URL). The CSRF token lives in this module's memory for the page's life.

let csrfToken = null;
const unauthorizedListeners = [];

export class ApiError extends Error {
  constructor(status, problem) {
    const detail = (problem && (problem.detail || problem.title)) || `HTTP ${status}`;
    super(detail);
    this.name = "ApiError";
    this.status = status;
    this.problem = problem || {};
    this.detail = detail;
    this.code = this.problem.code || null;
    this.errors = Array.isArray(this.problem.errors) ? this.problem.errors : [];
    this.retryAfter = null;
  }

  // "503 Service Unavailable: the fleet is disabled …"
  describe() {
    const title = this.problem.title ? ` ${this.problem.title}` : "";
    return `${this.status}${title}: ${this.detail}`;
  }
}

export function setCsrf(token) { csrfToken = token || null; }

export function onUnauthorized(fn) { unauthorizedListeners.push(fn); }

async function problemOf(resp) {
  const type = resp.headers.get("Content-Type") || "";
  if (type.includes("json")) {
    try { return await resp.json(); } catch (_) { /* fall through */ }
  }
  return { title: resp.statusText, detail: resp.statusText || `HTTP ${resp.status}` };
}

/** Call the API. `body` (an object) is sent as JSON. Resolves to parsed JSON, text or null. */
export async function api(path, { method = "GET", body, signal, accept = "json", quiet401 = false } = {}) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && method !== "HEAD" && csrfToken) headers["X-CSRF-Token"] = csrfToken;
  const resp = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
    cache: "no-store",
    signal,
  });
  if (!resp.ok) {
    const err = new ApiError(resp.status, await problemOf(resp));
    err.retryAfter = resp.headers.get("Retry-After");
    if (resp.status === 401 && !quiet401) unauthorizedListeners.forEach((fn) => fn(err));
    throw err;
  }
  if (resp.status === 204) return null;
  if (accept === "text") return resp.text();
  const type = resp.headers.get("Content-Type") || "";
  return type.includes("json") ? resp.json() : resp.text();
}

export const enc = encodeURIComponent;
