"""Ephemeral keys for browsers: ``POST /v1/realtime/client_secrets`` mints one, ``POST /v1/realtime/calls`` spends it.

The standard browser pattern keeps the real API key on the app's backend: the backend asks for a short-lived key
(``ek_...``) with the session it wants, hands it to the page, and the page posts its SDP offer with
``Authorization: Bearer ek_...``. A key here is spent by the first call that uses it and is worth nothing after its
TTL (``expires_after.seconds``, 10 s to 2 h, default 10 min, as OpenAI's); the session it was minted with is the
call's starting configuration. Keys live in this process's memory only: a restart forgets them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from livekit_omni import worker_ids
from livekit_omni.auth import EPHEMERAL_KEY_PREFIX as PREFIX
from livekit_omni.realtime import wire
from livekit_omni.realtime.config import RealtimeConfig
from livekit_omni.sessions.errors import error_response

DEFAULT_TTL_S: Final = 600
MIN_TTL_S: Final = 10
MAX_TTL_S: Final = 7200
#: Unspent keys kept at most (the oldest are dropped first): a bound on what a busy backend can make us hold.
MAX_KEYS: Final = 10_000
MAX_BODY_BYTES: Final = 256 * 1024


class _ExpiresAfter(msgspec.Struct, kw_only=True):
    anchor: str = "created_at"
    seconds: int = DEFAULT_TTL_S


class _CreateBody(msgspec.Struct, kw_only=True):
    expires_after: _ExpiresAfter | None = None
    session: wire.SessionConfig | None = None


_decoder: Final = msgspec.json.Decoder(_CreateBody)


@dataclass(frozen=True, slots=True)
class EphemeralKey:
    value: str
    expires_at: float
    session: wire.SessionConfig | None


class EphemeralKeys:
    """The unspent keys of this process. Invariant: every stored key's value starts with :data:`PREFIX`."""

    def __init__(self) -> None:
        self._keys: dict[str, EphemeralKey] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def mint(
        self, ttl_s: int, session: wire.SessionConfig | None, *, now: float | None = None
    ) -> EphemeralKey:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be {MIN_TTL_S}..{MAX_TTL_S}")
        now = time.time() if now is None else now
        self._expire(now)
        while len(self._keys) >= MAX_KEYS:
            self._keys.pop(next(iter(self._keys)))
        key = EphemeralKey(PREFIX + worker_ids.tagged(secrets.token_urlsafe(24)), now + ttl_s, session)
        self._keys[key.value] = key
        return key

    def redeem(self, value: str, *, now: float | None = None) -> EphemeralKey | None:
        """The key, removed (spent), if it exists and has not expired; else None."""
        now = time.time() if now is None else now
        key = self._keys.pop(value, None)
        if key is None or key.expires_at <= now:
            return None
        return key

    def _expire(self, now: float) -> None:
        for value in [v for v, k in self._keys.items() if k.expires_at <= now]:
            del self._keys[value]


def keys_of(app: Any) -> EphemeralKeys:
    """The app's key store, created on first use."""
    keys: EphemeralKeys | None = getattr(app.state, "realtime_client_secrets", None)
    if keys is None:
        keys = EphemeralKeys()
        app.state.realtime_client_secrets = keys
    return keys


async def create_client_secret(request: Request) -> Response:
    """``POST /v1/realtime/client_secrets`` (behind the app's API-key check)."""
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return error_response(400, "request_too_large", f"the body is limited to {MAX_BODY_BYTES} bytes")
    try:
        req = _decoder.decode(body or b"{}")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        return error_response(400, "invalid_value", f"invalid request: {e}")
    ttl = req.expires_after.seconds if req.expires_after is not None else DEFAULT_TTL_S
    if not MIN_TTL_S <= ttl <= MAX_TTL_S:
        return error_response(
            400, "invalid_value", f"expires_after.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}"
        )
    settings = request.app.state.settings
    config = RealtimeConfig(model=settings.model_name)
    if req.session is not None:
        try:
            config = config.apply(req.session)
        except wire.WireError as e:
            return error_response(400, e.code, e.message)
    key = keys_of(request.app).mint(ttl, req.session)
    echo = config.echo(session_id=wire.new_id("sess"), expires_at=int(key.expires_at))
    return JSONResponse(
        {
            "value": key.value,
            "expires_at": int(key.expires_at),
            "session": msgspec.to_builtins(echo),
        }
    )
