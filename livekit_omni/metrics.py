"""Prometheus metrics of the serving process (one registry, so tests and apps can create servers side by side)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_sessions = Gauge(
            "livekit_omni_active_sessions", "Open sessions", ["transport"], registry=r
        )
        self.sessions_total = Counter("livekit_omni_sessions", "Sessions started", ["transport"], registry=r)
        self.rejected_sessions = Counter(
            "livekit_omni_rejected_sessions", "Sessions refused at admission", ["reason"], registry=r
        )
        self.audio_in_seconds = Counter("livekit_omni_audio_in_seconds", "Caller audio received", registry=r)
        self.audio_out_seconds = Counter("livekit_omni_audio_out_seconds", "Model audio sent", registry=r)
        self.barge_ins = Counter("livekit_omni_barge_ins", "Caller interruptions of model speech", registry=r)
        self.errors = Counter("livekit_omni_errors", "Protocol and session errors", ["code"], registry=r)
        self.turn_latency = Histogram(
            "livekit_omni_turn_latency_seconds",
            "Caller speech stopped -> first reply audio",
            buckets=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0),
            registry=r,
        )
        self.ingress_overruns = Counter(
            "livekit_omni_ingress_overruns",
            "20 ms pieces of caller audio the ingress ring refused (full: the engine fell behind or stalled)",
            registry=r,
        )
        self.ingress_dropped_seconds = Counter(
            "livekit_omni_ingress_dropped_seconds", "Caller audio dropped at a full ingress ring", registry=r
        )
        self.engine_restarts = Gauge(
            "livekit_omni_engine_restarts", "Engine restarts since start", registry=r
        )
