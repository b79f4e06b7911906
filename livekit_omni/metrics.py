"""Prometheus metrics of the serving process (one registry, so tests and apps can create servers side by side)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

#: Loss counters of the media plane, summed over every session this process served (see :class:`MediaLosses`).
MEDIA_LOSS_KEYS = (
    "ingress_overruns",
    "egress_overruns",
    "egress_underruns",
    "transcripts_overflow",
    "events_too_large",
    "events_unread",
)


class MediaLosses(Collector):
    """The media plane's losses as counters, read at scrape time from ``source`` (the open sessions' counters plus
    those of sessions already ended): the per-frame paths count in plain ints, so nothing is added to them."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, int]] | None = None

    def collect(self) -> Iterator[Metric]:
        totals = dict.fromkeys(MEDIA_LOSS_KEYS, 0)
        if self.source is not None:
            totals.update(self.source())
        rings = CounterMetricFamily(
            "livekit_omni_ring_overruns",
            "Audio dropped because a ring was full: caller audio (ingress), reply audio (egress)",
            labels=["ring"],
        )
        rings.add_metric(["ingress"], totals["ingress_overruns"])
        rings.add_metric(["egress"], totals["egress_overruns"])
        yield rings
        yield CounterMetricFamily(
            "livekit_omni_egress_underruns",
            "Output frames only partly filled with reply audio (the engine fell behind real time)",
            value=totals["egress_underruns"],
        )
        dropped = CounterMetricFamily(
            "livekit_omni_dropped_events",
            "Server events not delivered: output transcripts dropped on queue overflow, events too large to "
            "send (replaced by an error), events queued for a client that stopped reading (disconnected)",
            labels=["reason"],
        )
        dropped.add_metric(["transcript_overflow"], totals["transcripts_overflow"])
        dropped.add_metric(["too_large"], totals["events_too_large"])
        dropped.add_metric(["client_not_reading"], totals["events_unread"])
        yield dropped


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
        self.sessions_detached = Counter(
            "livekit_omni_sessions_detached", "Sessions whose connection dropped, kept for resume", registry=r
        )
        self.sessions_resumed = Counter(
            "livekit_omni_sessions_resumed", "Detached sessions re-attached with their token", registry=r
        )
        self.detached_sessions_ended = Counter(
            "livekit_omni_detached_sessions_ended",
            "Detached sessions closed before a resume (expired, overflow, drain, ...)",
            ["reason"],
            registry=r,
        )
        self.resume_refused = Counter(
            "livekit_omni_resume_refused", "session.resume refusals", ["code"], registry=r
        )
        # The overruns themselves (20 ms pieces refused) are livekit_omni_ring_overruns_total{ring="ingress"}.
        self.ingress_dropped_seconds = Counter(
            "livekit_omni_ingress_dropped_seconds", "Caller audio dropped at a full ingress ring", registry=r
        )
        self.engine_restarts = Gauge(
            "livekit_omni_engine_restarts", "Engine restarts since start", registry=r
        )
        self.relayed_requests = Counter(
            "livekit_omni_relayed_requests",
            "Requests for another worker's session relayed to it (serve --workers), by what was relayed",
            ["kind"],
            registry=r,
        )
        self.media_losses = MediaLosses()
        r.register(self.media_losses)
