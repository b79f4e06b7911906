// Who is speaking, voice-to-voice latency and barge-in, measured in the page from the two level timelines
// (the local microphone and the received model audio), both on the AudioContext clock.
//
// Why in the page and not from server events: what a caller experiences is the gap between the end of their
// own speech and the first sound of the answer, and how quickly the answer goes quiet when they talk over it.
// The Live protocol has no barge-in event and its transcript timestamps are on the server's timeline, so the
// only honest measurement is the audio itself.

export const SILENCE_FLOOR_DB = -90;
/** Received audio above this is model speech (the server sends digital silence between replies). */
export const REMOTE_SPEECH_DB = -50;
/** The local threshold never goes below this, and sits this far above the tracked noise floor. */
export const LOCAL_MIN_DB = -48;
export const LOCAL_ABOVE_FLOOR_DB = 12;

const WINDOW_S = 0.01;
/** Consecutive loud windows before speech counts as started: ignores clicks. */
const ONSET_WINDOWS = 3;
/** Silence that ends a caller's utterance (sentence pauses are shorter) / a stretch of model audio. */
const LOCAL_HANGOVER_S = 0.5;
const REMOTE_HANGOVER_S = 0.3;
/** The model counts as playing when the caller starts if it was audible this recently. */
const PLAYING_WITHIN_S = 0.15;
/** After the caller starts talking over the model, the model must go quiet within this to count as barge-in… */
const BARGE_IN_WINDOW_S = 2.5;
/** …and stay quiet this long (a pause between two sentences of the answer is shorter). */
const BARGE_IN_CONFIRM_S = 0.7;

export function toDb(rms) {
  return rms > 0 ? Math.max(SILENCE_FLOOR_DB, 20 * Math.log10(rms)) : SILENCE_FLOOR_DB;
}

/** Speech on/off for one level timeline, with an onset debounce and a hangover. */
class SpeechDetector {
  constructor({ adaptive, hangoverS }) {
    this.adaptive = adaptive;
    this.hangoverS = hangoverS;
    this.noiseFloorDb = null;
    this.active = false;
    this.run = 0;
    this.runStart = 0;
    this.lastLoudEnd = -Infinity;
  }

  threshold() {
    if (!this.adaptive) return REMOTE_SPEECH_DB;
    return Math.max(LOCAL_MIN_DB, this.noiseFloorDb + LOCAL_ABOVE_FLOOR_DB);
  }

  /** One 10 ms window starting at `t`. Returns {onset: t} or {offset: t} (end of the last loud window), or null. */
  push(t, db) {
    if (this.adaptive) {
      // Minimum tracking, starting from the first window (people rarely talk the instant the mic opens): falls
      // at once, rises 1 dB/s, so the pauses in speech hold it near the room's noise and speech barely lifts it.
      this.noiseFloorDb = this.noiseFloorDb === null || db < this.noiseFloorDb ? db : this.noiseFloorDb + 0.01;
    }
    const loud = db > this.threshold();
    if (loud) {
      if (this.run === 0) this.runStart = t;
      this.run++;
      if (this.active || this.run >= ONSET_WINDOWS) this.lastLoudEnd = t + WINDOW_S;
      if (!this.active && this.run >= ONSET_WINDOWS) {
        this.active = true;
        return { onset: this.runStart };
      }
      return null;
    }
    this.run = 0;
    if (this.active && t + WINDOW_S - this.lastLoudEnd >= this.hangoverS) {
      this.active = false;
      return { offset: this.lastLoudEnd };
    }
    return null;
  }

  /** Loud right now (not just inside the hangover). */
  get loudNow() {
    return this.run >= ONSET_WINDOWS;
  }
}

/**
 * Feeds on level windows and reports, through callbacks:
 *   onSpeaking({who: "caller"|"model", speaking, t})
 *   onLatency({index, callerEnd, modelStart, ms})      per model turn that follows caller speech
 *   onBargeIn({index, onset, stop, stopMs})             the model went quiet after the caller talked over it
 *   onOverlap({onset, t})                               the caller talked over the model and it kept going
 */
export class ConversationTracker {
  constructor(callbacks = {}) {
    this.cb = callbacks;
    this.caller = new SpeechDetector({ adaptive: true, hangoverS: LOCAL_HANGOVER_S });
    this.model = new SpeechDetector({ adaptive: false, hangoverS: REMOTE_HANGOVER_S });
    this.callerSpokeSinceModelStart = false;
    this.latencies = [];
    this.bargeIns = [];
    this.overlaps = [];
    this.pending = null; // a possible barge-in: {onset, stop|null}
  }

  /** One 10 ms window: start time on the AudioContext clock and the two RMS levels (full scale 1.0). */
  push(t, localRms, remoteRms) {
    const c = this.caller.push(t, toDb(localRms));
    const m = this.model.push(t, toDb(remoteRms));
    if (c?.onset !== undefined) this._callerStarted(c.onset);
    if (c?.offset !== undefined) this.cb.onSpeaking?.({ who: "caller", speaking: false, t: c.offset });
    if (m?.onset !== undefined) this._modelStarted(m.onset);
    if (m?.offset !== undefined) this._modelStopped(m.offset);
    this._checkBargeIn(t + WINDOW_S);
  }

  _callerStarted(t) {
    this.callerSpokeSinceModelStart = true;
    this.cb.onSpeaking?.({ who: "caller", speaking: true, t });
    // "Model audio is playing": it was loud within the last 150 ms (a gap between syllables, not sentences).
    if (t - this.model.lastLoudEnd < PLAYING_WITHIN_S && !this.pending) this.pending = { onset: t, stop: null };
  }

  _modelStarted(t) {
    this.cb.onSpeaking?.({ who: "model", speaking: true, t });
    if (this.pending) this.pending.stop = null; // it was only a pause in the answer
    // A turn: the caller spoke since the model last started, and has gone quiet before this sound.
    if (this.callerSpokeSinceModelStart && !this.caller.loudNow && this.caller.lastLoudEnd <= t) {
      const rec = {
        index: this.latencies.length,
        callerEnd: this.caller.lastLoudEnd,
        modelStart: t,
        ms: Math.round((t - this.caller.lastLoudEnd) * 1000),
      };
      this.latencies.push(rec);
      this.callerSpokeSinceModelStart = false;
      this.cb.onLatency?.(rec);
    }
  }

  _modelStopped(t) {
    this.cb.onSpeaking?.({ who: "model", speaking: false, t });
    // The stop may precede the onset by up to PLAYING_WITHIN_S: the answer paused just before the caller spoke
    // and then never resumed.
    if (this.pending && t >= this.pending.onset - PLAYING_WITHIN_S) this.pending.stop = t;
  }

  _checkBargeIn(now) {
    const p = this.pending;
    if (!p) return;
    if (p.stop !== null && !this.model.active && now - p.stop >= BARGE_IN_CONFIRM_S) {
      const rec = {
        index: this.bargeIns.length,
        onset: p.onset,
        stop: p.stop,
        stopMs: Math.round((p.stop - p.onset) * 1000),
      };
      this.bargeIns.push(rec);
      this.pending = null;
      this.cb.onBargeIn?.(rec);
    } else if (p.stop === null && now - p.onset > BARGE_IN_WINDOW_S) {
      const rec = { onset: p.onset, t: now };
      this.overlaps.push(rec);
      this.pending = null;
      this.cb.onOverlap?.(rec);
    }
  }
}
