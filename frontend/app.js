// The livekit-omni browser client: one full-duplex voice call over OpenAI Live WebRTC, with live transcripts,
// speaking indicators, level meters, per-turn response time and barge-in markers.
//
// URL parameters: ?aec=0 turns echo cancellation, noise suppression and auto gain off (tests, headphones);
// ?ice=stun:host:3478,turn:… adds ICE servers; ?test=1 exposes window.lkoTest for the browser tests.

import { ConnectError, LiveClient } from "./live-client.js";
import { ConversationTracker, toDb } from "./activity.js";

const params = new URLSearchParams(location.search);
const TEST_MODE = params.get("test") === "1";
const STORAGE_KEY = "lko.apiKey";
const STORAGE_REMEMBER = "lko.rememberKey";
const STORAGE_AEC = "lko.aec";
/** Transcript fragments further apart than this (server timeline) start a new bubble. */
const TURN_GAP_MS = 1500;
/** A measured response time belongs to a model bubble created within this long of it. */
const LATENCY_ATTACH_S = 3;
const EVENT_LOG_MAX = 200;

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"),
  form: $("connect-form"),
  connect: $("connect"),
  apiKey: $("api-key"),
  remember: $("remember-key"),
  aec: $("aec"),
  notice: $("notice"),
  sessionInfo: $("session-info"),
  transcript: $("transcript"),
  empty: $("transcript-empty"),
  caller: $("speaker-caller"),
  model: $("speaker-model"),
  meterCaller: $("meter-caller"),
  meterModel: $("meter-model"),
  latencyLast: $("latency-last"),
  latencyMedian: $("latency-median"),
  bargeCount: $("barge-count"),
  promptForm: $("prompt-form"),
  promptText: $("prompt-text"),
  promptSend: $("prompt-send"),
  eventLog: $("event-log"),
  eventCount: $("event-count"),
  audio: $("remote-audio"),
};

// --- settings ---------------------------------------------------------------------------------------------

function loadSettings() {
  const remember = localStorage.getItem(STORAGE_REMEMBER) !== "0";
  ui.remember.checked = remember;
  ui.apiKey.value = remember ? localStorage.getItem(STORAGE_KEY) ?? "" : "";
  const aecParam = params.get("aec");
  if (aecParam !== null) ui.aec.checked = !["0", "false", "off"].includes(aecParam.toLowerCase());
  else ui.aec.checked = localStorage.getItem(STORAGE_AEC) !== "0";
}

function saveSettings() {
  localStorage.setItem(STORAGE_REMEMBER, ui.remember.checked ? "1" : "0");
  if (!ui.remember.checked) localStorage.removeItem(STORAGE_KEY);
  // A URL parameter is a one-off (tests, a shared link); only a click on the box changes the stored default.
  if (params.get("aec") === null) localStorage.setItem(STORAGE_AEC, ui.aec.checked ? "1" : "0");
}

/** Stored only once the server has accepted it, so a mistyped key is not offered again next time. */
function rememberKey() {
  const key = ui.apiKey.value.trim();
  if (ui.remember.checked && key) localStorage.setItem(STORAGE_KEY, key);
  else if (!key) localStorage.removeItem(STORAGE_KEY);
}

function iceServersFromUrl() {
  const list = params.get("ice");
  return list ? list.split(",").filter(Boolean).map((urls) => ({ urls })) : [];
}

// --- notices and status -----------------------------------------------------------------------------------

function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
}

/** @param {"error"|"warn"|"info"} level */
function notify(level, text, code = "") {
  ui.notice.hidden = false;
  ui.notice.dataset.level = level;
  ui.notice.dataset.code = code;
  ui.notice.textContent = text;
  test.notices.push({ level, code, text });
}

function clearNotice() {
  ui.notice.hidden = true;
  ui.notice.textContent = "";
  ui.notice.dataset.code = "";
}

function micErrorMessage(e) {
  switch (e?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return [
        "mic_denied",
        "Microphone access is blocked. Allow the microphone for this site (the icon at the left of the " +
          "address bar), then press Connect again.",
      ];
    case "NotFoundError":
    case "OverconstrainedError":
      return ["mic_missing", "No microphone was found. Connect one and press Connect again."];
    case "NotReadableError":
      return ["mic_busy", "The microphone is in use by another application or could not be started."];
    default:
      return ["mic_error", `The microphone could not be opened (${e?.name ?? "error"}: ${e?.message ?? e}).`];
  }
}

function connectErrorMessage(e) {
  switch (e.kind) {
    case "auth":
      return ui.apiKey.value
        ? "The server refused this API key. Check the key and press Connect again."
        : "This server needs an API key. Enter it in the API key field and press Connect.";
    case "full":
      return "The server is full: every session slot is in use. Try again in a minute.";
    case "unavailable":
      return `The server cannot take calls right now (${e.message}). Try again shortly.`;
    case "network":
      return `Cannot reach the server at ${location.origin}. Is it running? (${e.message})`;
    case "ice":
      return (
        "The call could not connect: no network path for the audio. A firewall or VPN may block UDP; a " +
        "server on another network needs STUN/TURN (add ?ice=stun:host:port to the address)."
      );
    default:
      return `The session could not start: ${e.message}`;
  }
}

const ERROR_KIND_CODE = { auth: "invalid_api_key", full: "session_limit_reached" };

// --- transcript -------------------------------------------------------------------------------------------

class Transcript {
  constructor(list) {
    this.list = list;
    this.items = [];
    this.pendingLatency = null;
  }

  clear() {
    this.items = [];
    this.list.replaceChildren();
    this.pendingLatency = null;
    ui.empty.hidden = false;
  }

  _append(el) {
    ui.empty.hidden = true;
    const atBottom = this.list.scrollHeight - this.list.scrollTop - this.list.clientHeight < 40;
    this.list.append(el);
    if (atBottom) this.list.scrollTop = this.list.scrollHeight;
  }

  /** One transcript fragment; fragments of the same side close together in time form one turn. */
  add(role, delta, startMs, endMs, audioTime) {
    if (!delta) return;
    const last = this.items.at(-1);
    if (last && last.kind === "turn" && last.role === role && startMs - last.endMs <= TURN_GAP_MS) {
      // Output fragments are appended as sent (the protocol's rule); input fragments from this server are
      // whole utterances without surrounding spaces, so two of them need one.
      const joiner = role === "caller" && !/\s$/.test(last.text) && !/^\s/.test(delta) ? " " : "";
      last.text += joiner + delta;
      last.endMs = Math.max(last.endMs, endMs);
      last.textEl.textContent = last.text.trim();
      return;
    }
    const li = document.createElement("li");
    li.className = `turn ${role}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "caller" ? "You" : "Model";
    const text = document.createElement("p");
    text.className = "text";
    text.textContent = delta.trim();
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = formatClock(startMs);
    li.append(who, text, meta);
    const item = { kind: "turn", role, text: delta, startMs, endMs, createdAt: audioTime, li, textEl: text, meta };
    this.items.push(item);
    this._append(li);
    if (role === "model" && this.pendingLatency && audioTime - this.pendingLatency.modelStart < LATENCY_ATTACH_S) {
      this._badge(item, this.pendingLatency);
      this.pendingLatency = null;
    }
  }

  /** A response time measured at `rec.modelStart`: goes on the model bubble of that moment, or the next one. */
  latency(rec) {
    const last = this.items.at(-1);
    const recent = last?.kind === "turn" && Math.abs(last.createdAt - rec.modelStart) < LATENCY_ATTACH_S;
    if (recent && last.role === "model" && !last.latency) {
      this._badge(last, rec);
    } else {
      this.pendingLatency = rec;
    }
  }

  _badge(item, rec) {
    item.latency = rec.ms;
    const b = document.createElement("span");
    b.className = "badge latency";
    b.title = "Time from the end of your speech to the first sound of this answer";
    b.textContent = `${(rec.ms / 1000).toFixed(2)} s`;
    item.meta.append(" · ", b);
  }

  /** A marker line: barge-in, a prompt sent, an error, the end of the session. */
  marker(kind, text) {
    if (kind === "barge-in") {
      // The answer that was talked over is the last model bubble.
      const lastModel = this.items.findLast((i) => i.kind === "turn" && i.role === "model");
      if (lastModel && !lastModel.interrupted) {
        lastModel.interrupted = true;
        lastModel.li.classList.add("interrupted");
      }
    }
    const li = document.createElement("li");
    li.className = `marker ${kind}`;
    li.textContent = text;
    this.items.push({ kind: "marker", type: kind, text, li });
    this._append(li);
  }

  snapshot() {
    return this.items.map((i) => {
      if (i.kind === "marker") return { kind: "marker", type: i.type, text: i.text };
      return {
        kind: "turn",
        role: i.role,
        text: i.text.trim(),
        startMs: i.startMs,
        endMs: i.endMs,
        latencyMs: i.latency ?? null,
        interrupted: Boolean(i.interrupted),
      };
    });
  }
}

function formatClock(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function median(values) {
  if (!values.length) return NaN;
  const s = [...values].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

// --- meters and speaking indicators -----------------------------------------------------------------------

class Meter {
  constructor(el) {
    this.el = el;
    this.fill = el.querySelector(".meter-fill");
    this.db = -60;
    this.shown = -60;
  }

  set(db) {
    this.db = db;
  }

  draw() {
    // Fast attack, ~30 dB/s release: readable without flicker.
    this.shown = this.db > this.shown ? this.db : Math.max(this.db, this.shown - 0.5);
    const pct = Math.max(0, Math.min(100, ((this.shown + 60) / 60) * 100));
    this.fill.style.width = `${pct.toFixed(1)}%`;
    this.el.setAttribute("aria-valuenow", String(Math.round(Math.max(-60, this.shown))));
  }
}

function setSpeaking(el, speaking) {
  el.dataset.speaking = String(speaking);
  el.querySelector(".speaker-state").textContent = speaking ? "speaking" : "silent";
}

// --- state ------------------------------------------------------------------------------------------------

const transcript = new Transcript(ui.transcript);
const meters = { caller: new Meter(ui.meterCaller), model: new Meter(ui.meterModel) };
/** What the browser tests read (window.lkoTest, only with ?test=1); timelines, capture and events only then. */
const test = {
  notices: [],
  events: [],
  errors: [],
  timeline: null, // {t0, dt, local: number[], remote: number[]}
  capture: null, // {rate, frame0, chunks: Int16Array[], samples}
  connectedAt: null,
  resumes: 0, // sessions resumed after a lost connection
};
/** The call in progress: {client, mic, ctx, node, tracker, userClosed} */
let call = null;
/** The last call's tracker: its measurements stay readable after the call ends. */
let lastTracker = null;
let connecting = false;
/** Server events of the current call (the visible log keeps only the last EVENT_LOG_MAX). */
let eventCount = 0;

function resetMeasurements() {
  transcript.clear();
  test.events = [];
  test.errors = [];
  test.notices = [];
  test.timeline = { t0: null, dt: 0.01, local: [], remote: [] };
  test.capture = { rate: null, frame0: null, chunks: [], samples: 0 };
  ui.latencyLast.textContent = "—";
  ui.latencyMedian.textContent = "—";
  ui.bargeCount.textContent = "0";
  ui.eventLog.replaceChildren();
  eventCount = 0;
  ui.eventCount.textContent = "0";
}

function setControls(connected) {
  ui.connect.textContent = connected ? "Disconnect" : connecting ? "Cancel" : "Connect";
  ui.connect.classList.toggle("danger", connected || connecting);
  ui.apiKey.disabled = connected || connecting;
  // Changing it mid-call re-opens the microphone with the new processing (switchMicrophone).
  ui.aec.disabled = connecting;
  ui.promptText.disabled = !connected;
  ui.promptSend.disabled = !connected;
}

// --- audio graph ------------------------------------------------------------------------------------------

async function startAudio(micStream, tracker) {
  // The device's own rate: Firefox cannot connect a microphone stream to a context running at another rate.
  const ctx = new AudioContext({ latencyHint: "interactive" });
  test.capture.rate = ctx.sampleRate;
  await ctx.audioWorklet.addModule(new URL("./audio-worklet.js", import.meta.url));
  const node = new AudioWorkletNode(ctx, "lko-level-meter", {
    numberOfInputs: 2,
    numberOfOutputs: 1,
    outputChannelCount: [1],
  });
  const micSource = ctx.createMediaStreamSource(micStream);
  micSource.connect(node, 0, 0);
  // The worklet writes silence; connecting it to the destination is what keeps the graph pulling it.
  node.connect(ctx.destination);
  node.port.onmessage = (e) => onWorkletMessage(e.data, ctx, tracker);
  if (TEST_MODE) node.port.postMessage({ type: "capture", enabled: true });
  if (ctx.state === "suspended") await ctx.resume();
  return { ctx, node, micSource };
}

function onWorkletMessage(msg, ctx, tracker) {
  if (msg.type === "levels") {
    const dt = msg.windowFrames / ctx.sampleRate;
    const tl = test.timeline;
    if (tl.t0 === null) tl.t0 = msg.frame / ctx.sampleRate;
    for (let i = 0; i < msg.local.length; i++) {
      const t = msg.frame / ctx.sampleRate + i * dt;
      tracker.push(t, msg.local[i], msg.remote[i]);
      if (TEST_MODE) {
        tl.local.push(msg.local[i]);
        tl.remote.push(msg.remote[i]);
      }
    }
    meters.caller.set(toDb(Math.max(...msg.local)));
    meters.model.set(toDb(Math.max(...msg.remote)));
  } else if (msg.type === "capture" && TEST_MODE) {
    const cap = test.capture;
    if (cap.frame0 === null) cap.frame0 = msg.frame;
    cap.chunks.push(msg.pcm);
    cap.samples += msg.pcm.length;
  }
}

function drawMeters() {
  meters.caller.draw();
  meters.model.draw();
  requestAnimationFrame(drawMeters);
}

// --- the call ---------------------------------------------------------------------------------------------

function makeTracker() {
  return new ConversationTracker({
    onSpeaking: ({ who, speaking }) => setSpeaking(who === "caller" ? ui.caller : ui.model, speaking),
    onLatency: (rec) => {
      transcript.latency(rec);
      const all = lastTracker?.latencies ?? [rec];
      ui.latencyLast.textContent = `${(rec.ms / 1000).toFixed(2)} s`;
      ui.latencyMedian.textContent = `${(median(all.map((r) => r.ms)) / 1000).toFixed(2)} s`;
    },
    onBargeIn: (rec) => {
      // stopMs <= 0: the answer had just paused when the caller spoke, and it did not go on.
      const text =
        rec.stopMs > 0
          ? `You interrupted: the model stopped ${rec.stopMs} ms after you started talking`
          : "You interrupted: the model stopped as you started talking";
      transcript.marker("barge-in", text);
      ui.bargeCount.textContent = String(lastTracker?.bargeIns.length ?? 1);
    },
  });
}

async function openMicrophone() {
  if (!navigator.mediaDevices?.getUserMedia) {
    const err = new Error("getUserMedia is unavailable");
    err.name = "InsecureContext";
    throw err;
  }
  const processing = ui.aec.checked;
  return navigator.mediaDevices.getUserMedia({
    audio: {
      echoCancellation: processing,
      noiseSuppression: processing,
      autoGainControl: processing,
      channelCount: 1,
    },
  });
}

/**
 * Re-open the microphone (with the current processing settings) and send the new track in place of the old
 * one: the call, its session and its measurements go on. Returns the AudioContext time of the switch.
 */
async function switchMicrophone() {
  if (!call) throw new Error("no call in progress");
  const mic = await openMicrophone();
  await call.client.replaceMicTrack(mic.getAudioTracks()[0]);
  call.micSource.disconnect();
  call.micSource = call.ctx.createMediaStreamSource(mic);
  call.micSource.connect(call.node, 0, 0);
  call.mic.getTracks().forEach((t) => t.stop());
  call.mic = mic;
  return call.ctx.currentTime;
}

function onProcessingChanged() {
  saveSettings();
  if (!call?.client.started) return;
  switchMicrophone().catch((e) => {
    const [code, text] = micErrorMessage(e);
    notify("error", text, code);
  });
}

async function connect() {
  if (call || connecting) return;
  connecting = true;
  saveSettings();
  clearNotice();
  resetMeasurements();
  setControls(false);
  let mic = null;
  let audio = null;
  let focusKey = false;
  try {
    const client = new LiveClient({ apiKey: ui.apiKey.value.trim(), iceServers: iceServersFromUrl() });
    // Key and server first: nobody should grant the microphone only to learn that the key is wrong.
    setStatus("connecting", "Contacting the server…");
    await client.resolveModel();
    setStatus("connecting", "Opening the microphone…");
    try {
      mic = await openMicrophone();
    } catch (e) {
      const [code, text] =
        e?.name === "InsecureContext"
          ? ["mic_insecure", "The microphone needs a secure page: open this over https, or on localhost."]
          : micErrorMessage(e);
      notify("error", text, code);
      setStatus("error", "Microphone unavailable");
      return;
    }
    const tracker = makeTracker();
    lastTracker = tracker;
    audio = await startAudio(mic, tracker);
    setStatus("connecting", "Connecting…");
    listen(client, audio);
    call = { client, mic, ...audio, tracker, userClosed: false, resuming: false };
    const started = await client.connect(mic.getAudioTracks()[0]);
    test.connectedAt = audio.ctx.currentTime;
    rememberKey();
    const id = started.session?.id ?? client.sessionId ?? "";
    setStatus("live", "Connected — speak any time");
    ui.sessionInfo.textContent = id ? `session ${id}` : "";
  } catch (e) {
    const cancelled = call?.userClosed;
    stopMedia(mic, audio);
    call = null;
    if (cancelled) {
      setStatus("idle", "Not connected");
    } else if (e instanceof ConnectError) {
      notify("error", connectErrorMessage(e), e.code || ERROR_KIND_CODE[e.kind] || e.kind);
      setStatus("error", "Not connected");
      focusKey = e.kind === "auth";
    } else {
      notify("error", `Could not connect: ${e?.message ?? e}`, "connect_failed");
      setStatus("error", "Not connected");
    }
  } finally {
    connecting = false;
    setControls(Boolean(call));
    // After setControls: the field is disabled while connecting, and a disabled field takes no focus.
    if (focusKey) ui.apiKey.focus();
  }
}

function listen(client, audio) {
  client.addEventListener("track", (e) => onRemoteStream(e.detail, audio));
  client.addEventListener("event", (e) => onServerEvent(e.detail));
  client.addEventListener("state", (e) => onConnectionState(e.detail));
  client.addEventListener("closed", (e) => onClosed(e.detail.reason));
}

/**
 * The connection failed (ICE) but the server keeps the session for a while: offer again with its resume token,
 * keeping the microphone and the audio graph. The same session goes on (its conversation and what the model was
 * saying); no history needs re-sending. If the server cannot resume it, the call ends as before.
 */
async function resumeCall(current) {
  const lost = current.client;
  current.resuming = true;
  setStatus("connecting", "Connection lost — resuming the session…");
  transcript.marker("resume", "Connection lost; resuming the same session…");
  const client = new LiveClient({ apiKey: lost.apiKey, iceServers: lost.iceServers, model: lost.model });
  listen(client, current);
  current.client = client;
  try {
    const started = await client.connect(current.mic.getAudioTracks()[0], { resumeToken: lost.resumeToken });
    current.resuming = false;
    test.resumes += 1;
    const id = started.session?.id ?? client.sessionId ?? "";
    setStatus("live", "Connected — speak any time");
    ui.sessionInfo.textContent = id ? `session ${id}` : "";
    transcript.marker("resume", "Resumed.");
  } catch (e) {
    current.resuming = false;
    onClosed(current.userClosed ? "close_requested" : "resume_failed");
  }
}

function onRemoteStream(stream, audio) {
  // Required: Chromium pulls and decodes a remote track only while a media element plays it. The element is
  // also what the person hears (echo cancellation references what media elements play).
  ui.audio.srcObject = stream;
  ui.audio.play().catch(() => notify("warn", "Click anywhere on the page to hear the model.", "autoplay"));
  audio.ctx.createMediaStreamSource(stream).connect(audio.node, 0, 1);
}

function logEvent(ev) {
  eventCount++;
  // Every event is kept only for the tests; the visible log keeps the last EVENT_LOG_MAX.
  if (TEST_MODE) test.events.push({ type: ev.type, t: call?.ctx.currentTime ?? null });
  const li = document.createElement("li");
  const detail = ev.delta ?? ev.error?.code ?? ev.reason ?? "";
  li.textContent = detail ? `${ev.type}  ${JSON.stringify(detail).slice(0, 80)}` : ev.type;
  ui.eventLog.prepend(li);
  while (ui.eventLog.childElementCount > EVENT_LOG_MAX) ui.eventLog.lastElementChild.remove();
  ui.eventCount.textContent = String(eventCount);
}

function onServerEvent(ev) {
  logEvent(ev);
  const now = call?.ctx.currentTime ?? 0;
  switch (ev.type) {
    case "session.input_transcript.delta":
      transcript.add("caller", ev.delta ?? "", ev.start_ms ?? 0, ev.end_ms ?? 0, now);
      break;
    case "session.output_transcript.delta":
      transcript.add("model", ev.delta ?? "", ev.start_ms ?? 0, ev.end_ms ?? 0, now);
      break;
    case "session.usage.updated": {
      const secs = Math.round(ev.usage?.seconds ?? 0);
      const id = call?.client.sessionId;
      ui.sessionInfo.textContent = `${id ? `session ${id} · ` : ""}${formatClock(secs * 1000)}`;
      break;
    }
    case "error": {
      const code = ev.error?.code ?? "error";
      const message = ev.error?.message ?? "unknown error";
      test.errors.push({ code, message, type: ev.error?.type ?? "" });
      transcript.marker("error", `Server error (${code}): ${message}`);
      // A session-ending error arrives just before `session.closed`: the end notice names it (onClosed).
      if (call && code in SESSION_END_ERRORS) call.serverError = { code, message };
      if (code === "invalid_api_key") notify("error", connectErrorMessage({ kind: "auth" }), code);
      else if (code === "session_limit_reached") notify("error", connectErrorMessage({ kind: "full" }), code);
      break;
    }
    default:
      // Everything else (session.started, appends' receipts, events this page does not know) is only logged:
      // a conformance client must tolerate unknown events.
      break;
  }
}

function onConnectionState(state) {
  if (!call?.client.started) return;
  if (state === "disconnected") setStatus("warn", "Connection interrupted — trying to recover…");
  else if (state === "connected") setStatus("live", "Connected — speak any time");
}

// Why the server ended a call, for the errors that end one (docs/protocol.md, "Why the session ends").
const SESSION_END_ERRORS = {
  engine_lost: "The voice engine stopped, so the server ended the session.",
  session_ended: "The voice engine ended the session.",
  server_shutdown: "The server is shutting down.",
};

function onClosed(reason) {
  // A lost connection (ICE failed, or the channel dropped without session.closed) with a session to resume.
  const lost = reason === "connection_failed" || reason === "data_channel_closed";
  if (lost && call && !call.userClosed && !call.resuming && call.client.resumeToken) {
    resumeCall(call);
    return;
  }
  const userClosed = call?.userClosed;
  const serverError = call?.serverError;
  stopMedia(call?.mic, call);
  call = null;
  setControls(false);
  setSpeaking(ui.caller, false);
  setSpeaking(ui.model, false);
  setStatus("idle", "Not connected");
  if (userClosed || reason === "close_requested") {
    transcript.marker("end", "Call ended.");
    return;
  }
  if (serverError) {
    const why = SESSION_END_ERRORS[serverError.code];
    transcript.marker("end", why);
    notify("error", `${why} Press Connect to start a new session.`, serverError.code);
    return;
  }
  const why = {
    connection_failed: "The connection was lost.",
    resume_failed: "The connection was lost, and the session could not be resumed.",
    data_channel_closed: "The server closed the connection.",
    expired: "The session reached its time limit.",
    connection_lost: "The server ended the session (connection lost).",
  }[reason] ?? `The session ended (${reason}).`;
  transcript.marker("end", why);
  notify("warn", `${why} Press Connect to start a new session.`, reason);
}

function stopMedia(mic, audio) {
  mic?.getTracks().forEach((t) => t.stop());
  if (audio?.node) audio.node.port.onmessage = null;
  audio?.ctx?.close().catch(() => {});
  ui.audio.srcObject = null;
}

async function disconnect() {
  if (!call) return;
  call.userClosed = true;
  setStatus("connecting", "Hanging up…");
  await call.client.close();
}

// --- prompt box -------------------------------------------------------------------------------------------

function sendPrompt(event) {
  event.preventDefault();
  const content = ui.promptText.value.trim();
  if (!content || !call) return;
  if (call.client.send({ type: "session.commentary.append", content, delegation_id: null })) {
    transcript.marker("prompt", `Prompt sent: “${content}”`);
    ui.promptText.value = "";
  }
}

// --- test hooks -------------------------------------------------------------------------------------------

function base64OfInt16(samples) {
  const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

function captureSlice(offset, count) {
  const cap = test.capture;
  const end = Math.min(cap.samples, offset + count);
  const out = new Int16Array(Math.max(0, end - offset));
  let pos = 0;
  for (const chunk of cap.chunks) {
    if (pos + chunk.length > offset && pos < end) {
      const from = Math.max(0, offset - pos);
      const to = Math.min(chunk.length, end - pos);
      out.set(chunk.subarray(from, to), pos + from - offset);
    }
    pos += chunk.length;
    if (pos >= end) break;
  }
  return out;
}

function installTestHooks() {
  window.lkoTest = {
    status: () => ({
      state: ui.status.dataset.state,
      text: ui.status.textContent,
      connected: Boolean(call?.client.started),
      sessionId: call?.client.sessionId ?? null,
      clock: call?.ctx.currentTime ?? null,
      connectedAt: test.connectedAt,
      aec: ui.aec.checked,
      // What the browser actually applied (echoCancellation, noiseSuppression, autoGainControl, …).
      mic: call?.mic.getAudioTracks()[0]?.getSettings() ?? null,
      notice: ui.notice.hidden ? null : { code: ui.notice.dataset.code, text: ui.notice.textContent },
    }),
    notices: () => test.notices,
    resumes: () => test.resumes,
    transcripts: () => transcript.snapshot(),
    events: () => test.events,
    errors: () => test.errors,
    latencies: () => lastTracker?.latencies ?? [],
    bargeIns: () => lastTracker?.bargeIns ?? [],
    overlaps: () => lastTracker?.overlaps ?? [],
    /** Per-10 ms RMS of the local mic and the received audio from window `from` on (AudioContext clock). */
    timeline: (from = 0) => {
      const tl = test.timeline;
      const [local, remote] = [tl.local.slice(from), tl.remote.slice(from)];
      return { t0: tl.t0, dt: tl.dt, count: tl.local.length, local, remote };
    },
    captureInfo: () => ({ rate: test.capture.rate, frame0: test.capture.frame0, samples: test.capture.samples }),
    /** Re-open the microphone mid-call (a fake capture device then plays its file again, from the start). */
    reopenMicrophone: () => switchMicrophone(),
    /** Base64 little-endian PCM16 mono of the received audio, samples [offset, offset + count). */
    captureChunk: (offset, count) => base64OfInt16(captureSlice(offset, count)),
  };
}

// --- start ------------------------------------------------------------------------------------------------

ui.form.addEventListener("submit", (e) => {
  e.preventDefault();
  if (call || connecting) {
    if (call) disconnect();
  } else {
    connect();
  }
});
ui.promptForm.addEventListener("submit", sendPrompt);
ui.remember.addEventListener("change", saveSettings);
ui.aec.addEventListener("change", onProcessingChanged);
loadSettings();
resetMeasurements();
setControls(false);
requestAnimationFrame(drawMeters);
if (TEST_MODE) installTestHooks();
