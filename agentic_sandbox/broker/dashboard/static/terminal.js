// A session terminal: xterm.js over the `sandbox.pty.v1` WebSocket.
//
// Binary frames from the server are an 8-byte big-endian offset followed by output bytes; the
// page remembers where the stream is (`nextOffset`) and reattaches with `from=<nextOffset>`
// after a dropped connection, so nothing is lost or shown twice. Text frames are JSON control
// messages (hello, role, members, resize, resync, exit, error, pong).

const SUBPROTOCOL = "sandbox.pty.v1";

export class SessionTerminal {
  constructor(container, sessionId, { wantControl, onState }) {
    this.sessionId = sessionId;
    this.wantControl = wantControl;
    this.onState = onState || (() => {});
    this.role = null;
    this.members = [];
    this.nextOffset = null;
    this.reconnects = 0;
    this.lastHello = null;
    this.exited = null;
    this.closedByUser = false;
    this.ws = null;
    this.retry = 0;
    this.encoder = new TextEncoder();
    this.term = new window.Terminal({
      convertEol: false,
      cursorBlink: true,
      scrollback: 5000,
      fontSize: 14,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      theme: { background: "#0b0d12" },
    });
    this.fit = new window.FitAddon.FitAddon();
    this.term.loadAddon(this.fit);
    this.term.open(container);
    this.fit.fit();
    this.term.onData((data) => this.input(this.encoder.encode(data)));
    this.term.onBinary((data) => {
      const bytes = new Uint8Array(data.length);
      for (let i = 0; i < data.length; i += 1) bytes[i] = data.charCodeAt(i) & 0xff;
      this.input(bytes);
    });
    this.term.onResize(({ cols, rows }) => this.sendResize(cols, rows));
    this.onWindowResize = () => { if (this.role === "controller") this.fit.fit(); };
    window.addEventListener("resize", this.onWindowResize);
    this.connect();
  }

  url() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const params = new URLSearchParams({ role: this.wantControl ? "control" : "observe" });
    if (this.nextOffset !== null) params.set("from", String(this.nextOffset));
    return `${proto}//${location.host}/api/v2/admin/sessions/${encodeURIComponent(this.sessionId)}/attach?${params}`;
  }

  connect() {
    this.state("connecting");
    const ws = new WebSocket(this.url(), [SUBPROTOCOL]);  // the session cookie authenticates
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => { this.retry = 0; this.state("connected"); };
    ws.onmessage = (ev) => (typeof ev.data === "string" ? this.control(JSON.parse(ev.data)) : this.output(ev.data));
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (this.closedByUser || this.exited !== null) { this.state(this.exited !== null ? "exited" : "detached"); return; }
      if (ev.code === 1008 || ev.code === 4401) { this.state("refused"); return; }
      const delay = Math.min(10000, 250 * 2 ** this.retry) * (0.5 + Math.random() / 2);
      this.retry += 1;
      this.state(`reconnecting in ${(delay / 1000).toFixed(1)}s`);
      setTimeout(() => { if (!this.closedByUser) { this.reconnects += 1; this.connect(); } }, delay);
    };
  }

  output(buffer) {
    const view = new DataView(buffer);
    const offset = Number(view.getBigUint64(0, false));
    const bytes = new Uint8Array(buffer, 8);
    if (this.nextOffset !== null && offset !== this.nextOffset) {
      // Never expected (the server guarantees continuity); show it rather than hide it.
      this.message(`stream jumped from ${this.nextOffset} to ${offset}`);
    }
    this.term.write(bytes);
    this.nextOffset = offset + bytes.length;
    this.onState(this);
  }

  control(msg) {
    switch (msg.type) {
      case "hello":
        this.lastHello = msg;
        if (msg.from !== null && msg.from !== undefined) this.nextOffset = msg.from;
        this.setRole(msg.role);
        this.members = msg.members;
        if (msg.role !== "controller") this.term.resize(msg.cols, msg.rows);
        break;
      case "role":
        this.setRole(msg.role);
        this.wantControl = msg.role === "controller";  // a reattach keeps the role we have
        this.message(msg.reason ? `you are now ${msg.role}: ${msg.reason}` : "");
        break;
      case "members":
        this.members = msg.members;
        break;
      case "resize":
        if (this.role !== "controller") this.term.resize(msg.cols, msg.rows);
        break;
      case "resync":
        this.term.reset();
        if (this.role !== "controller") this.term.resize(msg.cols, msg.rows);
        this.term.write(msg.screen);
        this.nextOffset = msg.offset;
        if (msg.reason === "behind") this.message("fell behind: skipped ahead to the current screen");
        break;
      case "exit":
        this.exited = msg;
        this.message(msg.signal ? `session ended by signal ${msg.signal}` : `session exited with code ${msg.code}`);
        break;
      case "error":
        this.message(`${msg.code}: ${msg.message}`);
        break;
      default:
        break;
    }
    this.onState(this);
  }

  setRole(role) {
    this.role = role;
    if (role === "controller") {
      this.fit.fit();
      this.sendResize(this.term.cols, this.term.rows);
    }
  }

  input(bytes) {
    if (this.role !== "controller" || !this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    this.ws.send(bytes);
  }

  send(obj) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(obj));
  }

  sendResize(cols, rows) {
    if (this.role === "controller") this.send({ type: "resize", cols, rows });
  }

  takeControl() { this.wantControl = true; this.send({ type: "request_control", force: true }); }

  releaseControl() { this.wantControl = false; this.send({ type: "release_control" }); }

  reconnect() {
    // Drop the connection and attach again from the last offset (lossless).
    if (this.ws) { const ws = this.ws; this.ws = null; ws.close(); }
    this.reconnects += 1;
    this.connect();
  }

  close() {
    this.closedByUser = true;
    window.removeEventListener("resize", this.onWindowResize);
    if (this.ws) this.ws.close();
    this.term.dispose();
  }

  state(text) { this.status = text; this.onState(this); }

  message(text) { this.lastMessage = text; this.onState(this); }
}
