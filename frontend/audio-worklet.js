// AudioWorklet for the page's level meters, speech timing and (test mode) capture of the received audio.
//
// Input 0 is the local microphone, input 1 the remote (model) track. Both are measured in the same process()
// call, so every number this worklet reports is on one clock: the AudioContext's sample clock. That is what
// makes the page's voice-to-voice latency and barge-in timings comparable to within one 10 ms window, which
// wall-clock timestamps on the main thread cannot do (they jitter by a frame or more).
//
// Messages to the main thread:
//   {type: "levels", frame, windowFrames, local: Float32Array, remote: Float32Array}
//       RMS (full scale = 1.0) of consecutive 10 ms windows; `frame` is the first window's start on the
//       AudioContext sample clock (seconds = frame / sampleRate). Windows are contiguous across messages.
//   {type: "capture", frame, pcm: Int16Array}      (only after {type: "capture", enabled: true})
//       the remote audio, mono, at the context's sample rate, contiguous from the first message on.

const WINDOWS_PER_MESSAGE = 5; // 50 ms: smooth meters without 100 messages a second
const CAPTURE_FRAMES_PER_MESSAGE = 4800; // 100 ms at 48 kHz

class LevelMeterProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.windowFrames = Math.round(sampleRate / 100);
    this.windowStart = -1;
    this.count = 0;
    this.sumLocal = 0;
    this.sumRemote = 0;
    this.local = new Float32Array(WINDOWS_PER_MESSAGE);
    this.remote = new Float32Array(WINDOWS_PER_MESSAGE);
    this.filled = 0;
    this.batchStart = 0;
    this.capturing = false;
    this.capture = null;
    this.captureLength = 0;
    this.captureStart = 0;
    this.port.onmessage = (e) => {
      if (e.data && e.data.type === "capture") {
        this.capturing = Boolean(e.data.enabled);
      }
    };
  }

  // Mono mix of one input; null when nothing is connected (the input then has no channels).
  static mono(input, n) {
    if (!input || input.length === 0) return null;
    if (input.length === 1) return input[0];
    const out = new Float32Array(n);
    for (const ch of input) for (let i = 0; i < n; i++) out[i] += ch[i];
    for (let i = 0; i < n; i++) out[i] /= input.length;
    return out;
  }

  process(inputs) {
    const n = 128;
    const frame0 = currentFrame;
    const local = LevelMeterProcessor.mono(inputs[0], n);
    const remote = LevelMeterProcessor.mono(inputs[1], n);
    if (this.windowStart < 0) this.windowStart = frame0;
    for (let i = 0; i < n; i++) {
      const l = local ? local[i] : 0;
      const r = remote ? remote[i] : 0;
      this.sumLocal += l * l;
      this.sumRemote += r * r;
      if (++this.count === this.windowFrames) this.closeWindow();
    }
    if (this.capturing) this.captureBlock(frame0, remote, n);
    return true;
  }

  closeWindow() {
    if (this.filled === 0) this.batchStart = this.windowStart;
    this.local[this.filled] = Math.sqrt(this.sumLocal / this.count);
    this.remote[this.filled] = Math.sqrt(this.sumRemote / this.count);
    this.filled++;
    this.windowStart += this.count;
    this.count = 0;
    this.sumLocal = 0;
    this.sumRemote = 0;
    if (this.filled === WINDOWS_PER_MESSAGE) {
      this.port.postMessage({
        type: "levels",
        frame: this.batchStart,
        windowFrames: this.windowFrames,
        local: this.local.slice(),
        remote: this.remote.slice(),
      });
      this.filled = 0;
    }
  }

  captureBlock(frame0, remote, n) {
    if (!this.capture) {
      this.capture = new Int16Array(CAPTURE_FRAMES_PER_MESSAGE);
      this.captureLength = 0;
      this.captureStart = frame0;
    }
    for (let i = 0; i < n; i++) {
      const s = remote ? Math.max(-1, Math.min(1, remote[i])) : 0;
      this.capture[this.captureLength++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.captureLength === this.capture.length) {
        const pcm = this.capture;
        this.port.postMessage({ type: "capture", frame: this.captureStart, pcm }, [pcm.buffer]);
        this.capture = new Int16Array(CAPTURE_FRAMES_PER_MESSAGE);
        this.captureStart += this.captureLength;
        this.captureLength = 0;
      }
    }
  }
}

registerProcessor("lko-level-meter", LevelMeterProcessor);
