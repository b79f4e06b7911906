"""Realtime responses: what the dialect keeps of each one, and its wire form.

A response projects one engine reply (one turn of one epoch) once the engine starts it (``ReplyStarted``); until
then it waits, and one the engine never starts fails after :data:`RESPONSE_START_TIMEOUT_S`. The session
(:mod:`livekit_omni.realtime.session`) drives the records; this module holds them and builds ``response`` objects.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from engine_bridge import protocol as p
from livekit_omni.realtime import wire
from livekit_omni.realtime.items import ItemRecord

#: A response the engine has not started this long after it was created ends ``failed`` (it never hangs open).
RESPONSE_START_TIMEOUT_S: Final = 30.0
#: Finished responses remembered (to find the reply of one the client cancelled), oldest forgotten first.
RESPONSES_KEPT: Final = 64


@dataclass(slots=True)
class ResponseRecord:
    id: str
    modalities: list[str]
    metadata: dict[str, Any] | None
    max_output_tokens: int | str
    item: ItemRecord | None = None
    #: The engine reply it projects (epoch, turn), once it started.
    reply: tuple[int, int] | None = None
    #: The engine finished generating; the response ends with the reply's last frame.
    generated: bool = False
    finished: bool = False
    cancel_reason: str | None = None
    #: Output timeline (ms) of the response's first audio frame.
    first_frame_ms: int | None = None
    audio_buf: bytearray = field(default_factory=bytearray)
    audio_frames: int = 0
    text: str = ""
    #: The engine's token counts of the reply (ReplyDone): input, cached, output.
    tokens: tuple[int, int, int] | None = None
    #: When it was created (monotonic): a response the engine never starts fails after a while.
    created_at: float = field(default_factory=time.monotonic)
    #: ``conversation: "none"``: the answer is not added to the conversation (the engine forgets it afterwards).
    out_of_band: bool = False
    #: The engine stopped the reply at the client's ``max_output_tokens``: it ends ``incomplete``.
    capped: bool = False
    #: The function calls the reply ended in (``function_call`` items after its message item).
    calls: list[ItemRecord] = field(default_factory=list)
    #: The response had tools of its own: the session's, which the engine lists again once it ends.
    restore_tools: list[p.ToolDef] | None = None

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def never_started(self) -> bool:
        return self.reply is None and time.monotonic() - self.created_at > RESPONSE_START_TIMEOUT_S

    def output(self) -> list[wire.Item]:
        """The response's output items: its message, then its function calls."""
        head = [self.item.item] if self.item is not None else []
        return head + [c.item for c in self.calls]

    def said(self) -> str:
        """The words of the answer so far (what the caller heard, for audio)."""
        if not self.audio:
            return self.text
        return " ".join(w for w, _ in (self.item.words if self.item else []))


class ResponseLog:
    """The session's responses, newest last, within :data:`RESPONSES_KEPT`."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, ResponseRecord] = OrderedDict()

    def add(self, r: ResponseRecord) -> None:
        self._records[r.id] = r
        while len(self._records) > RESPONSES_KEPT:
            self._records.popitem(last=False)

    def of_reply(self, epoch: int, turn_id: int, *, out_of_band: bool | None = None) -> ResponseRecord | None:
        """The newest response that projects the engine reply (epoch, turn) (only out-of-band ones, if asked)."""
        for r in reversed(self._records.values()):
            if r.reply == (epoch, turn_id) and (out_of_band is None or r.out_of_band == out_of_band):
                return r
        return None


def response_wire(
    r: ResponseRecord, status: str, reason: str | None, *, context_tokens: int, conversation_id: str
) -> wire.Response:
    """The ``response`` object of ``r`` at ``status`` (usage once it is over: the engine's counts, or, for one cut
    before the engine reported them, the context size it last reported and the words that were said)."""
    details = None
    if status == "failed":
        details = wire.StatusDetails(
            type=status,
            error=wire.StatusError(
                type=wire.SERVER_ERROR,
                code="response_not_started",
                message=f"the engine did not start the reply within {RESPONSE_START_TIMEOUT_S:g} s",
            ),
        )
    elif status != "in_progress":
        details = wire.StatusDetails(type=status, reason=reason)
    usage = None
    if status != "in_progress":
        if r.tokens is not None:
            inp, cached, out = r.tokens
        else:
            inp, cached, out = context_tokens, 0, len(r.said().split())
        usage = wire.ResponseUsage(
            total_tokens=inp + out,
            input_tokens=inp,
            output_tokens=out,
            input_token_details=wire.InputTokenDetails(text_tokens=inp, cached_tokens=cached),
            output_token_details=wire.OutputTokenDetails(
                text_tokens=out if not r.audio else 0, audio_tokens=out if r.audio else 0
            ),
        )
    return wire.Response(
        id=r.id,
        status=status,
        status_details=details,
        output=r.output(),
        conversation_id=None if r.out_of_band else conversation_id,
        output_modalities=r.modalities,
        max_output_tokens=r.max_output_tokens,  # type: ignore[arg-type]
        metadata=r.metadata,
        usage=usage,
    )


def keep_engine_text(r: ResponseRecord, text: str) -> None:
    """The engine's kept text of a cut reply: the item holds no more than that."""
    rec = r.item
    if rec is None or not rec.item.content:
        return
    part = rec.item.content[0]
    heard = " ".join(w for w, _ in rec.words)
    kept = text.strip() if len(text.strip()) < len(heard) else heard
    if r.audio:
        part.transcript = kept
    else:
        part.text = kept
