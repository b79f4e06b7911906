"""API-key auth of the HTTP app and the Live WebSocket: one bearer-token parser, one key check, one middleware.

With API keys configured, every endpoint but /health and the static page needs ``Authorization: Bearer <key>``.
Plain HTTP requests without a valid key get 401 from :class:`AuthMiddleware`. WebSocket upgrades are let through
and the Live facade answers them with an ``error`` event (code ``invalid_api_key``) and a close, because LiveKit's
client retries a failed handshake but treats that error as final (see docs/protocol.md).

Its own module so that the app (which installs the middleware) and the WebSocket route (which checks the key after
the upgrade) both depend on it, rather than the route on the app that mounts it.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from livekit_omni.metrics import Metrics
from livekit_omni.settings import Settings

#: Paths (prefixes) that answer without a key: the health probe and the static frontend.
PUBLIC_PATHS: Final = ("/health", "/static/", "/favicon.ico")
#: Paths (suffixes) that take an ephemeral key (``ek_...``) instead of an API key and check it themselves.
EPHEMERAL_KEY_PATHS: Final = ("/realtime/calls",)
EPHEMERAL_KEY_PREFIX: Final = "ek_"


def bearer_token(headers: Mapping[str, str]) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; empty when there is none."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_is_valid(settings: Settings, token: str) -> bool:
    """True when no keys are configured or ``token`` is one of them (compared in constant time)."""
    if not settings.api_keys:
        return True
    return any(hmac.compare_digest(token, k) for k in settings.api_keys)


class AuthMiddleware:
    """Refuses HTTP requests without a valid key (401, OpenAI-style error body); WebSockets pass through."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.settings.api_keys:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/" or path.startswith(PUBLIC_PATHS) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        token = bearer_token(request.headers)
        if path.endswith(EPHEMERAL_KEY_PATHS) and token.startswith(EPHEMERAL_KEY_PREFIX):
            # A browser's ephemeral key (livekit_omni.realtime.client_secrets): the route itself spends it.
            await self.app(scope, receive, send)
            return
        if not key_is_valid(self.settings, token):
            app = scope.get("app")
            metrics: Metrics | None = getattr(app.state, "metrics", None) if app is not None else None
            if metrics is not None:
                metrics.errors.labels(code="invalid_api_key").inc()
            resp = JSONResponse(
                {
                    "error": {
                        "type": "invalid_request_error",
                        "code": "invalid_api_key",
                        "message": "missing or invalid API key",
                        "param": None,
                    }
                },
                status_code=401,
            )
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
