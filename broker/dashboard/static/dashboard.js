// Dashboard entry point: login with a token, then the views.
const $ = (sel) => document.querySelector(sel);
let csrf = null;

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (csrf && options.method && options.method !== "GET") headers["X-CSRF-Token"] = csrf;
  const resp = await fetch(path, Object.assign({}, options, { headers, credentials: "same-origin" }));
  if (!resp.ok) {
    let detail = resp.statusText;
    try { detail = (await resp.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(detail);
  }
  return resp.status === 204 ? null : resp.json();
}

async function showApp() {
  const me = await api("/api/v2/admin/whoami");
  csrf = me.csrf_token;
  $("#who").textContent = `${me.subject} (${me.role})`;
  $("#login").hidden = true;
  $("#app").hidden = false;
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("#login-error").textContent = "";
  try {
    await api("/api/v2/admin/login", { method: "POST", body: JSON.stringify({ token: $("#token").value.trim() }) });
    await showApp();
  } catch (err) {
    $("#login-error").textContent = `Sign-in failed: ${err.message}`;
  }
});

showApp().catch(() => { /* not signed in yet */ });
