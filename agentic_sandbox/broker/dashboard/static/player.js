// Recording playback: an asciicast v2 file (GET /api/v2/admin/sessions/{id}/recording) played
// in its own xterm.js instance with its timing: play/pause, speed, seek, idle-time limit.
//
// asciicast v2: a JSON header line ({version: 2, width, height, timestamp, idle_time_limit?}),
// then one JSON array per line: [seconds, code, data] with code `o` output, `r` resize
// ("COLSxROWS"), `i` input (not replayed) and `m` marker (shown as a message).

const DEFAULT_IDLE_LIMIT = 2.0; // seconds: long pauses are shortened, as asciinema does

export function parseCast(text) {
  const lines = text.split("\n");
  let header;
  try { header = JSON.parse(lines[0]); } catch (_) { throw new Error("not an asciicast file (bad header)"); }
  if (!header || header.version !== 2) throw new Error(`unsupported asciicast version ${header && header.version}`);
  const events = [];
  let skipped = 0;
  for (const line of lines.slice(1)) {
    if (!line.trim()) continue;
    try {
      const ev = JSON.parse(line);
      if (Array.isArray(ev) && ev.length >= 3 && typeof ev[0] === "number" && typeof ev[1] === "string") {
        events.push([ev[0], ev[1], String(ev[2])]);
      } else skipped += 1;
    } catch (_) { skipped += 1; } // a line cut by a crash: skip it
  }
  events.sort((a, b) => a[0] - b[0]);
  return { header, events, skipped };
}

/** Event times with every pause longer than `limit` shortened to `limit`. */
function compress(events, limit) {
  const out = [];
  let prev = 0;
  let acc = 0;
  for (const ev of events) {
    const gap = Math.max(0, ev[0] - prev);
    acc += limit > 0 ? Math.min(gap, limit) : gap;
    prev = ev[0];
    out.push(acc);
  }
  return out;
}

export class CastPlayer {
  constructor(container, cast, { onState, idleLimit } = {}) {
    this.cast = cast;
    this.onState = onState || (() => {});
    const header = cast.header;
    this.cols = header.width || 80;
    this.rows = header.height || 24;
    const limit = idleLimit ?? header.idle_time_limit ?? DEFAULT_IDLE_LIMIT;
    this.times = compress(cast.events, limit);
    this.duration = this.times.length ? this.times[this.times.length - 1] : 0;
    this.speed = 1;
    this.state = "paused";
    this.index = 0; // next event to apply
    this.position = 0; // seconds of (compressed) recording time
    this.markers = [];
    this.timer = null;
    this.term = new window.Terminal({
      cols: this.cols,
      rows: this.rows,
      disableStdin: true,
      cursorBlink: false,
      scrollback: 5000,
      fontSize: 14,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      theme: { background: "#0b0d12" },
    });
    this.term.open(container);
    this.emit();
  }

  emit() { this.onState(this); }

  // Apply every event up to `pos` (in one write, so seeking is fast).
  applyUntil(pos) {
    let chunk = "";
    const flush = () => { if (chunk) { this.term.write(chunk); chunk = ""; } };
    while (this.index < this.cast.events.length && this.times[this.index] <= pos) {
      const [, code, data] = this.cast.events[this.index];
      if (code === "o") chunk += data;
      else if (code === "r") {
        const m = /^(\d+)x(\d+)$/.exec(data);
        if (m) { flush(); this.term.resize(Number(m[1]), Number(m[2])); }
      } else if (code === "m") {
        this.markers.push(data);
        this.lastMarker = data;
      }
      this.index += 1;
    }
    flush();
  }

  play() {
    if (this.state === "playing") return;
    if (this.index >= this.cast.events.length) this.seek(0);
    this.state = "playing";
    this.startWall = performance.now() - (this.position / this.speed) * 1000;
    this.tick();
  }

  pause() {
    if (this.state !== "playing") return;
    this.position = this.now();
    clearTimeout(this.timer);
    this.state = "paused";
    this.emit();
  }

  toggle() { if (this.state === "playing") this.pause(); else this.play(); }

  now() { return Math.min(this.duration, ((performance.now() - this.startWall) / 1000) * this.speed); }

  tick() {
    if (this.state !== "playing") return;
    this.position = this.now();
    this.applyUntil(this.position);
    if (this.index >= this.cast.events.length) {
      this.position = this.duration;
      this.state = "ended";
      this.emit();
      return;
    }
    const wait = ((this.times[this.index] - this.position) / this.speed) * 1000;
    this.timer = setTimeout(() => this.tick(), Math.max(0, Math.min(wait, 250)));
    this.emit();
  }

  setSpeed(speed) {
    if (!(speed > 0)) return;
    if (this.state === "playing") this.position = this.now();
    this.speed = speed;
    if (this.state === "playing") {
      this.startWall = performance.now() - (this.position / this.speed) * 1000;
      clearTimeout(this.timer);
      this.tick();
    } else this.emit();
  }

  seek(pos) {
    const target = Math.max(0, Math.min(this.duration, pos));
    clearTimeout(this.timer);
    this.term.reset();
    this.term.resize(this.cols, this.rows);
    this.index = 0;
    this.markers = [];
    this.lastMarker = null;
    this.applyUntil(target);
    this.position = target;
    if (this.state === "ended" && target < this.duration) this.state = "paused";
    if (this.state === "playing") {
      this.startWall = performance.now() - (this.position / this.speed) * 1000;
      this.tick();
    } else this.emit();
  }

  dispose() {
    clearTimeout(this.timer);
    this.state = "closed";
    this.term.dispose();
  }
}
