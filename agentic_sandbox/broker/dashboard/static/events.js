// The live event feed (GET /api/v1/events/stream, Server-Sent Events) and the events panel.
// The stream is opened through api() like every other call (its failures are the same
// ApiErrors); a 401 ends the feed and signs the page out, anything else is retried with backoff.
//
// The server names each SSE message after its event type (`event: session.created`), and the
// set of types is open-ended (fleet events are mirrored as they come). EventSource can only
// listen to names it is told in advance, so the stream is read with fetch() and parsed here:
// same wire format, same cookie, and on reconnect the `Last-Event-ID` header carries the seq of
// the last event handled, so the server replays exactly what was missed (no gap, no duplicate).
// `event: gap` (the server dropped events for this slow client) is shown as a notice and every
// view is reloaded from the API.

import { api, ApiError } from "/static/api.js";
import { $, el, fmtTime, shortId } from "/static/dom.js";

const STREAM = "/api/v1/events/stream";
const BACKLOG = 50; // events shown from before the page opened
const MAX_SHOWN = 300;

export class EventFeed {
  constructor({ onEvent, onGap, onStatus, onUnauthorized }) {
    this.onEvent = onEvent;
    this.onGap = onGap;
    this.onStatus = onStatus || (() => {});
    this.onUnauthorized = onUnauthorized || (() => {});
    this.lastEventId = null; // seq of the last event handled (string, as SSE ids are)
    this.retryMs = 2000;
    this.failures = 0;
    this.connects = 0;
    this.received = 0;
    this.gaps = 0;
    this.status = "idle";
    this.controller = null;
    this.stopped = true;
    this.timer = null;
  }

  async start() {
    this.stopped = false;
    if (this.lastEventId === null) {
      // Start a little in the past so the panel is not empty; the stream replays from there.
      try {
        const page = await api("/api/v1/events?limit=1", { quiet401: true });
        this.startAfter = Math.max(0, page.last_seq - BACKLOG);
      } catch (err) {
        this.startAfter = 0;
        if (err instanceof ApiError && err.status === 401) { this.setStatus("signed-out"); this.onUnauthorized(); return; }
      }
    }
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.controller) this.controller.abort();
    this.controller = null;
    this.setStatus("stopped");
  }

  /** Drop the connection and resume from the last event handled. */
  reconnect() {
    if (this.controller) this.controller.abort();
    clearTimeout(this.timer);
    this.connect();
  }

  setStatus(status, detail = "") {
    this.status = status;
    this.onStatus(status, detail);
  }

  async connect() {
    if (this.stopped) return;
    const controller = new AbortController();
    this.controller = controller;
    const headers = { Accept: "text/event-stream" };
    let url = STREAM;
    if (this.lastEventId !== null) headers["Last-Event-ID"] = this.lastEventId;
    else url += `?after=${this.startAfter || 0}`;
    this.connects += 1;
    this.setStatus(this.connects > 1 ? "reconnecting" : "connecting");
    let resp;
    try {
      resp = await api(url, { headers, accept: "stream", signal: controller.signal, quiet401: true });
    } catch (err) {
      if (this.controller !== controller) return; // replaced by reconnect() or stopped
      if (!(err instanceof ApiError)) return this.retryLater(controller, "the stream was interrupted");
      if (err.kind === "unauthorized") { this.setStatus("signed-out"); this.onUnauthorized(err); return; }
      if (err.status === 400 && err.code === "invalid-cursor") {
        // The server no longer knows our cursor (a fresh database): start again from its newest.
        this.lastEventId = null;
        this.startAfter = 0;
        try { this.startAfter = (await api("/api/v1/events?limit=1")).last_seq; } catch (_) { /* retried */ }
        this.onGap({ data: { reason: "the server's event history restarted" } });
      }
      return this.retryLater(controller, err.explain());
    }
    this.failures = 0;
    this.setStatus("live");
    try {
      await this.read(resp.body, controller);
    } catch (err) {
      if (this.controller !== controller) return; // replaced by reconnect() or stopped
    }
    if (this.controller === controller) this.retryLater(controller, "the stream ended");
  }

  retryLater(controller, why) {
    if (this.stopped || this.controller !== controller) return;
    this.failures += 1;
    const delay = Math.min(30000, this.retryMs * 2 ** Math.max(0, this.failures - 1)) * (0.75 + Math.random() / 4);
    this.setStatus("reconnecting", `${why}; retrying in ${(delay / 1000).toFixed(1)}s`);
    clearTimeout(this.timer);
    this.timer = setTimeout(() => { if (this.controller === controller) this.connect(); }, delay);
  }

  async read(body, controller) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let message = { id: null, event: "message", data: [] };
    for (;;) {
      const { value, done } = await reader.read();
      if (done || this.controller !== controller) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.search(/\r\n|\r|\n/)) >= 0) {
        if (nl === buffer.length - 1 && buffer[nl] === "\r") break; // maybe half of a CRLF
        const line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + (buffer.startsWith("\r\n", nl) ? 2 : 1));
        if (line === "") {
          if (message.data.length) this.dispatch(message);
          message = { id: null, event: "message", data: [] };
          continue;
        }
        if (line.startsWith(":")) continue; // keepalive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") message.data.push(val);
        else if (field === "event") message.event = val;
        else if (field === "id") message.id = val;
        else if (field === "retry" && /^\d+$/.test(val)) this.retryMs = Number(val);
      }
    }
  }

  dispatch(message) {
    let payload;
    try { payload = JSON.parse(message.data.join("\n")); } catch (_) { return; }
    if (message.event === "gap") {
      this.gaps += 1;
      this.onGap(payload);
      return;
    }
    if (message.id !== null) {
      // Never show an event twice (a resumed stream starts after Last-Event-ID anyway).
      if (this.lastEventId !== null && Number(message.id) <= Number(this.lastEventId)) return;
      this.lastEventId = message.id;
    }
    this.received += 1;
    this.onEvent(payload);
  }
}

// ---- the panel ------------------------------------------------------------------------------
function summary(ev) {
  const d = ev.data || {};
  const bits = [];
  if (d.state) bits.push(`state ${d.state}`);
  if (d.stage) bits.push(`stage ${d.stage}`);
  if (d.kind && ev.type.startsWith("operation.")) bits.push(d.kind);
  if (d.role) bits.push(`role ${d.role}`);
  if (d.subject && typeof d.subject === "string") bits.push(d.subject);
  if (d.code !== undefined && d.code !== null) bits.push(`exit ${d.code}`);
  if (d.reason && typeof d.reason === "string") bits.push(d.reason);
  if (d.error && d.error.cause) bits.push(`${d.error.stage}: ${d.error.cause}`);
  if (d.cause && typeof d.cause === "string") bits.push(d.cause);
  if (d.detail && typeof d.detail === "string") bits.push(d.detail);
  return bits.join(" · ");
}

export class EventsPanel {
  constructor() {
    this.list = $("#events");
    this.filter = $("#events-filter");
    this.paused = false;
    this.held = [];
    this.seen = new Set();
    this.filter.addEventListener("change", () => this.applyFilter());
    $("#events-pause").addEventListener("click", () => this.togglePause());
    $("#events-clear").addEventListener("click", () => { this.list.replaceChildren(); this.updateEmpty(); });
    $("#events-gap-dismiss").addEventListener("click", () => { $("#events-gap").hidden = true; });
    this.updateEmpty();
  }

  add(ev) {
    if (this.seen.has(ev.seq)) return;
    this.seen.add(ev.seq);
    if (this.seen.size > 5000) this.seen = new Set(Array.from(this.seen).slice(-MAX_SHOWN * 2));
    if (this.paused) { this.held.push(ev); $("#events-pause").textContent = `Resume (${this.held.length})`; return; }
    this.render(ev);
  }

  render(ev) {
    const family = ev.type.split(".")[0];
    const subject = family === "task" && ev.task_id ? `task ${shortId(ev.task_id)}`
      : ev.session_id ? `session ${shortId(ev.session_id)}`
        : ev.task_id ? `task ${shortId(ev.task_id)}`
          : ev.instance_id ? ev.instance_id
            : ev.host ? `host ${ev.host}` : "";
    const item = el("li", { class: `event fam-${family}`, dataset: { seq: String(ev.seq), type: ev.type, family } },
      el("div", { class: "event-line" },
        el("span", { class: "event-type" }, ev.type),
        el("span", { class: "event-subject", title: ev.session_id || ev.task_id || ev.instance_id || "" }, subject),
        el("time", { class: "event-time", datetime: ev.time, title: `seq ${ev.seq}` }, fmtTime(ev.time))),
      el("div", { class: "event-summary" }, [ev.actor ? `by ${ev.actor}` : "", summary(ev)].filter(Boolean).join(" · ")));
    item.hidden = !this.matches(family);
    this.list.prepend(item);
    while (this.list.children.length > MAX_SHOWN) this.list.lastElementChild.remove();
    this.updateEmpty();
  }

  matches(family) { return !this.filter.value || this.filter.value === family; }

  applyFilter() {
    for (const li of this.list.children) li.hidden = !this.matches(li.dataset.family);
    this.updateEmpty();
  }

  togglePause() {
    this.paused = !this.paused;
    const btn = $("#events-pause");
    btn.setAttribute("aria-pressed", String(this.paused));
    if (!this.paused) {
      const held = this.held;
      this.held = [];
      held.forEach((ev) => this.render(ev));
      btn.textContent = "Pause";
    } else {
      btn.textContent = "Resume";
    }
  }

  gap(payload) {
    const data = (payload && payload.data) || {};
    const first = data.first_missed_seq;
    $("#events-gap-text").textContent = first
      ? `Some events were missed (from seq ${first}): the stream fell behind. The views were reloaded from the server.`
      : `Events may have been missed (${data.reason || "stream gap"}). The views were reloaded from the server.`;
    $("#events-gap").hidden = false;
  }

  updateEmpty() {
    const visible = Array.from(this.list.children).some((li) => !li.hidden);
    $("#events-empty").hidden = visible;
  }
}

export function renderFeedStatus(status, detail) {
  const pill = $("#feed-status");
  const labels = {
    connecting: "events: connecting…", live: "events: live", reconnecting: "events: reconnecting",
    "signed-out": "events: signed out", stopped: "events: off", idle: "",
  };
  pill.textContent = labels[status] ?? status;
  pill.dataset.state = status;
  pill.title = detail || "";
}
