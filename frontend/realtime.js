// The OpenAI Realtime API's browser pattern against this server (served at /static/realtime.html).
//
// 1. An ephemeral key: POST /v1/realtime/client_secrets with the API key. A real app does this on its backend,
//    so the API key never reaches the page; this demo page does it itself.
// 2. getUserMedia → RTCPeerConnection with the microphone track, a data channel named "oai-events".
// 3. The SDP offer POSTed to /v1/realtime/calls with "Authorization: Bearer ek_…"; the 201's body is the answer.
// 4. JSON events on the data channel (session.update, response.*, conversation.*); the model's audio plays from
//    the remote track.
//
// URL parameters: ?key=<API key> fills the key field; ?aec=0 turns echo cancellation, noise suppression and auto
// gain off (tests, headphones). window.realtimeDemo exposes the call's state for tests: events received, the
// remote audio level every 20 ms, and reopenMicrophone() (a new capture on the same call).

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const AEC = !["0", "false", "off"].includes((params.get("aec") || "1").toLowerCase());
const INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly.";

const state = {
  pc: null,
  channel: null,
  mic: null,
  events: [],
  arrivals: [], // performance.now() ms at which each event arrived
  levels: [], // [performance.now() ms, RMS dBFS] of the remote audio, every 20 ms
  errors: [],
  status: "idle",
};

function setStatus(status, text) {
  state.status = status;
  $("status").dataset.state = status;
  $("status").textContent = text;
}

function notify(message) {
  $("notice").hidden = !message;
  $("notice").textContent = message || "";
}

function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function ephemeralKey(apiKey) {
  const response = await fetch("/v1/realtime/client_secrets", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders(apiKey) },
    body: JSON.stringify({ session: { type: "realtime", instructions: INSTRUCTIONS } }),
  });
  if (!response.ok) throw new Error(`client secret refused: ${await errorMessage(response)}`);
  return (await response.json()).value;
}

function openMicrophone() {
  return navigator.mediaDevices.getUserMedia({
    audio: { echoCancellation: AEC, noiseSuppression: AEC, autoGainControl: AEC },
  });
}

function meterRemote(stream) {
  // The element plays the audio; an analyser on the same stream measures it (Chromium feeds WebAudio from a
  // remote WebRTC stream only while a media element also plays it).
  const ctx = new AudioContext();
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  ctx.createMediaStreamSource(stream).connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    if (!state.pc) {
      clearInterval(timer);
      ctx.close();
      return;
    }
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    for (const x of buf) sum += x * x;
    const db = 10 * Math.log10(sum / buf.length + 1e-12);
    state.levels.push([performance.now(), db]);
    if (state.levels.length > 30000) state.levels.splice(0, 10000);
  }, 20);
}

function showEvent(ev) {
  let who = null;
  let text = null;
  if (ev.type === "conversation.item.input_audio_transcription.completed") [who, text] = ["You", ev.transcript];
  if (ev.type === "response.done") {
    const part = ev.response.output?.[0]?.content?.[0];
    [who, text] = ["Model", (part?.transcript ?? part?.text ?? "") + (ev.response.status === "cancelled" ? " …" : "")];
  }
  if (ev.type === "error") notify(ev.error.message);
  if (who && text) {
    const li = document.createElement("li");
    li.textContent = `${who}: ${text}`;
    $("transcript").append(li);
  }
  if (ev.type === "output_audio_buffer.started") setStatus("speaking", "The model is speaking");
  if (ev.type === "output_audio_buffer.stopped" || ev.type === "output_audio_buffer.cleared") {
    setStatus("connected", "Listening");
  }
}

async function connect() {
  notify("");
  setStatus("connecting", "Connecting…");
  const apiKey = $("api-key").value.trim();
  const key = await ephemeralKey(apiKey);
  state.mic = await openMicrophone();
  const pc = new RTCPeerConnection();
  state.pc = pc;
  pc.addTrack(state.mic.getAudioTracks()[0], state.mic);
  pc.ontrack = (e) => {
    const stream = e.streams[0] || new MediaStream([e.track]);
    $("remote-audio").srcObject = stream;
    meterRemote(stream);
  };
  pc.onconnectionstatechange = () => {
    if (["failed", "closed"].includes(pc.connectionState)) hangUp("The call ended.");
  };
  const channel = pc.createDataChannel("oai-events");
  state.channel = channel;
  channel.onmessage = (m) => {
    const ev = JSON.parse(m.data);
    state.events.push(ev);
    state.arrivals.push(performance.now());
    showEvent(ev);
  };
  const opened = new Promise((resolve) => channel.addEventListener("open", resolve, { once: true }));
  await pc.setLocalDescription(await pc.createOffer());
  const response = await fetch("/v1/realtime/calls", {
    method: "POST",
    headers: { "Content-Type": "application/sdp", ...authHeaders(key) },
    body: pc.localDescription.sdp,
  });
  if (response.status !== 201) throw new Error(`the call was refused: ${await errorMessage(response)}`);
  state.callId = (response.headers.get("Location") || "").split("/").pop();
  await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  await opened;
  send({ type: "session.update", session: { type: "realtime", instructions: INSTRUCTIONS } });
  setStatus("connected", "Listening");
  $("connect").disabled = true;
  $("hangup").disabled = false;
}

function send(event) {
  if (state.channel?.readyState === "open") state.channel.send(JSON.stringify(event));
}

function hangUp(message) {
  state.channel?.close();
  state.pc?.close();
  state.mic?.getTracks().forEach((t) => t.stop());
  state.pc = state.channel = state.mic = null;
  setStatus("idle", message || "Not connected");
  $("connect").disabled = false;
  $("hangup").disabled = true;
}

async function reopenMicrophone() {
  const mic = await openMicrophone();
  const sender = state.pc.getSenders().find((s) => s.track?.kind === "audio");
  await sender.replaceTrack(mic.getAudioTracks()[0]);
  state.mic?.getTracks().forEach((t) => t.stop());
  state.mic = mic;
  return performance.now();
}

$("connect-form").addEventListener("submit", (e) => {
  e.preventDefault();
  connect().catch((err) => {
    state.errors.push(String(err));
    notify(String(err.message || err));
    hangUp("Not connected");
  });
});
$("hangup").addEventListener("click", () => hangUp());
if (params.get("key")) $("api-key").value = params.get("key");

window.realtimeDemo = {
  status: () => state.status,
  callId: () => state.callId,
  events: (from = 0) => state.events.slice(from),
  arrivals: (from = 0) => state.arrivals.slice(from),
  levels: (from = 0) => state.levels.slice(from),
  errors: () => state.errors.slice(),
  now: () => performance.now(),
  reopenMicrophone,
  hangUp: () => hangUp(),
};
