// The OpenAI Live WebRTC flow, as a browser client (docs/protocol.md):
//
//   1. POST {base}/v1/live/sessions  {session: {model}, transport: {type: "webrtc", sdp: <offer>}}
//      → {session: {id}, transport: {type: "webrtc", sdp: <answer>}}
//   2. server events arrive as JSON text on the data channel "oai-events", `session.started` first;
//      the client never sends `session.start` there.
//
//   Resume (docs/protocol.md, Resume): `session.started` carries a single-use `resume_token`. After the
//   connection fails (ICE), the server keeps the session for a grace period; a new offer with
//   {resume_token, transport} instead of {session, transport} re-attaches to it, and its `session.started`
//   carries the next token.
//
// Audio goes both ways on one sendrecv audio transceiver. ICE is non-trickle: the offer is sent once
// gathering is complete (or after a timeout with what has been gathered), which costs ~120 ms and needs no
// trickle endpoint on the server.

export const DATA_CHANNEL_LABEL = "oai-events";
const GATHER_TIMEOUT_MS = 3000;
const STARTED_TIMEOUT_MS = 15000;
const CLOSE_WAIT_MS = 1500;

/** A connection attempt that failed, with a `kind` the page turns into a message a person can act on. */
export class ConnectError extends Error {
  /**
   * @param {"auth"|"full"|"unavailable"|"http"|"network"|"ice"|"protocol"} kind
   * @param {string} message
   * @param {{status?: number, code?: string}} [info]
   */
  constructor(kind, message, info = {}) {
    super(message);
    this.kind = kind;
    this.status = info.status;
    this.code = info.code;
  }
}

function authHeaders(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

// Error codes that mean "this key will never work": the same set LiveKit's client treats as fatal.
const AUTH_CODES = new Set(["invalid_api_key", "forbidden", "account_deactivated"]);
const FULL_CODES = new Set(["session_limit_reached", "rate_limit_exceeded"]);
const UNAVAILABLE_CODES = new Set(["engine_unavailable", "engine_lost", "server_shutdown"]);

/** Map an HTTP error response (status + the Live error body, if any) to a ConnectError. */
async function httpError(response, what) {
  let code = "";
  let message = "";
  try {
    const body = await response.json();
    code = body?.error?.code ?? "";
    message = body?.error?.message ?? "";
  } catch {
    // Not JSON (a proxy's error page, for instance): the status alone decides.
  }
  const info = { status: response.status, code };
  if (response.status === 401 || response.status === 403 || AUTH_CODES.has(code)) {
    return new ConnectError("auth", message || "the API key was refused", info);
  }
  if (FULL_CODES.has(code) || (response.status === 503 && !UNAVAILABLE_CODES.has(code))) {
    return new ConnectError("full", message || "the server has no free session", info);
  }
  if (UNAVAILABLE_CODES.has(code) || response.status === 502 || response.status === 504) {
    return new ConnectError("unavailable", message || "the server cannot take calls right now", info);
  }
  return new ConnectError("http", `${what} failed: HTTP ${response.status} ${message}`.trim(), info);
}

function waitForGathering(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve(true);
  return new Promise((resolve) => {
    const done = (complete) => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", onChange);
      resolve(complete);
    };
    const onChange = () => {
      if (pc.iceGatheringState === "complete") done(true);
    };
    const timer = setTimeout(() => done(false), timeoutMs);
    pc.addEventListener("icegatheringstatechange", onChange);
  });
}

/**
 * One Live session over WebRTC.
 *
 * Events (EventTarget):
 *   "track"   detail: MediaStream        the model's audio
 *   "event"   detail: object             every server event from the data channel, parsed
 *   "state"   detail: string             RTCPeerConnection connectionState changes
 *   "closed"  detail: {reason: string}   the call ended (server close, failure, or close())
 */
export class LiveClient extends EventTarget {
  /**
   * @param {{baseUrl?: string, apiKey?: string, iceServers?: RTCIceServer[], model?: string}} options
   */
  constructor({ baseUrl = "", apiKey = "", iceServers = [], model = "" } = {}) {
    super();
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.apiKey = apiKey;
    this.iceServers = iceServers;
    this.model = model;
    this.pc = null;
    this.transceiver = null;
    this.channel = null;
    this.sessionId = null;
    /** The token of the last `session.started`, for resuming this session on a new connection. */
    this.resumeToken = null;
    this.started = false;
    this.closed = false;
    this._closedSeen = null;
  }

  /** The model name the server advertises; also the cheapest way to find out whether the key works. */
  async resolveModel() {
    if (this.model) return this.model;
    let response;
    try {
      response = await fetch(`${this.baseUrl}/v1/models`, { headers: authHeaders(this.apiKey) });
    } catch (e) {
      throw new ConnectError("network", `cannot reach the server (${e.message})`);
    }
    if (!response.ok) throw await httpError(response, "GET /v1/models");
    const body = await response.json();
    this.model = body?.data?.[0]?.id || "livekit-omni";
    return this.model;
  }

  /**
   * Offer the microphone track, get the answer, and resolve once `session.started` has arrived.
   * With `resumeToken` (an earlier client's `resumeToken`) the offer resumes that session instead of starting one.
   * @param {MediaStreamTrack} micTrack
   * @param {{resumeToken?: string|null}} [options]
   * @returns {Promise<object>} the `session.started` event
   */
  async connect(micTrack, { resumeToken = null } = {}) {
    const model = resumeToken ? null : await this.resolveModel();
    const pc = new RTCPeerConnection({ iceServers: this.iceServers });
    this.pc = pc;
    this.transceiver = pc.addTransceiver(micTrack, { direction: "sendrecv" });
    pc.addEventListener("track", (e) => {
      const stream = e.streams[0] ?? new MediaStream([e.track]);
      this.dispatchEvent(new CustomEvent("track", { detail: stream }));
    });
    pc.addEventListener("connectionstatechange", () => {
      this.dispatchEvent(new CustomEvent("state", { detail: pc.connectionState }));
      if (pc.connectionState === "failed") this._finish("connection_failed");
    });

    const channel = pc.createDataChannel(DATA_CHANNEL_LABEL);
    this.channel = channel;
    const started = new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new ConnectError("protocol", "the server did not start the session (no session.started)")),
        STARTED_TIMEOUT_MS,
      );
      this._onStarted = (ev) => {
        clearTimeout(timer);
        resolve(ev);
      };
      this._onEarlyClose = (reason) => {
        clearTimeout(timer);
        reject(new ConnectError(reason === "connection_failed" ? "ice" : "protocol", reason));
      };
    });
    // Marked handled now: it may reject (ICE failure) while the POST is still in flight; `await started`
    // below still sees the rejection.
    started.catch(() => {});
    channel.addEventListener("message", (e) => this._onMessage(e.data));
    channel.addEventListener("close", () => this._finish("data_channel_closed"));

    await pc.setLocalDescription(await pc.createOffer());
    await waitForGathering(pc, GATHER_TIMEOUT_MS);

    let response;
    try {
      response = await fetch(`${this.baseUrl}/v1/live/sessions`, {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders(this.apiKey) },
        body: JSON.stringify(
          resumeToken
            ? { resume_token: resumeToken, transport: { type: "webrtc", sdp: pc.localDescription.sdp } }
            : { session: { model }, transport: { type: "webrtc", sdp: pc.localDescription.sdp } },
        ),
      });
    } catch (e) {
      this._teardown();
      throw new ConnectError("network", `cannot reach the server (${e.message})`);
    }
    if (!response.ok) {
      this._teardown();
      throw await httpError(response, "POST /v1/live/sessions");
    }
    const body = await response.json();
    const answer = body?.transport?.sdp;
    if (typeof answer !== "string") {
      this._teardown();
      throw new ConnectError("protocol", "the server's answer has no transport.sdp");
    }
    this.sessionId = body?.session?.id ?? null;
    await pc.setRemoteDescription({ type: "answer", sdp: answer });
    try {
      return await started;
    } catch (e) {
      this._teardown();
      throw e;
    }
  }

  _onMessage(data) {
    if (typeof data !== "string") return; // the protocol is JSON text only; ignore anything else
    let ev;
    try {
      ev = JSON.parse(data);
    } catch {
      return;
    }
    if (!ev || typeof ev !== "object" || typeof ev.type !== "string") return;
    if (ev.type === "session.started") {
      this.started = true;
      if (ev.session?.id) this.sessionId = ev.session.id;
      if (typeof ev.resume_token === "string") this.resumeToken = ev.resume_token;
      this._onStarted?.(ev);
    }
    this.dispatchEvent(new CustomEvent("event", { detail: ev }));
    if (ev.type === "session.closed") {
      this.resumeToken = null; // the server ended it: nothing to resume
      this._closedSeen?.();
      this._finish(ev.reason || "closed");
    }
  }

  /** Send another microphone track in place of the current one, without renegotiating. */
  async replaceMicTrack(track) {
    await this.transceiver.sender.replaceTrack(track);
  }

  /** Send one client event on the data channel; false if the channel is not open. */
  send(event) {
    if (!this.channel || this.channel.readyState !== "open") return false;
    this.channel.send(JSON.stringify(event));
    return true;
  }

  /** End the call politely: `session.close`, a short wait for `session.closed`, then hang up. */
  async close() {
    if (this.closed) return;
    if (this.started && this.send({ type: "session.close" })) {
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, CLOSE_WAIT_MS);
        this._closedSeen = () => {
          clearTimeout(timer);
          resolve();
        };
      });
    }
    this._finish("close_requested");
  }

  _finish(reason) {
    if (this.closed) return;
    if (!this.started) {
      this._onEarlyClose?.(reason);
      return;
    }
    this._teardown();
    this.dispatchEvent(new CustomEvent("closed", { detail: { reason } }));
  }

  _teardown() {
    this.closed = true;
    try {
      this.channel?.close();
    } catch {
      // already closed
    }
    this.pc?.close();
  }
}
