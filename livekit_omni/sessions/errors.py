"""The error every dialect answers a refused command with: a code a client's policy keys on, a message, and where.

Both dialects' ``error`` events carry the same fields (``type``, ``code``, ``message``, ``param``), so the refusal
is one exception type for the whole serving side; each dialect's wire module turns it into its own event.
"""

from __future__ import annotations

from typing import Final

from starlette.responses import JSONResponse

#: ``error.type`` of a refusal caused by the client's command.
INVALID_REQUEST: Final = "invalid_request_error"
#: ``error.type`` of a failure on the server's side (engine full or gone, an internal error).
SERVER_ERROR: Final = "server_error"


class WireError(Exception):
    """A command the server refuses; becomes an ``error`` event (the session goes on unless the caller ends it)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        client_event_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.type = type
        self.client_event_id = client_event_id


def invalid_api_key() -> WireError:
    """The refusal of a connection without a valid key (every dialect's socket; final for LiveKit and the SDK)."""
    return WireError("invalid_api_key", "missing or invalid API key (send Authorization: Bearer <key>)")


def error_response(status: int, code: str, message: str, *, type: str = INVALID_REQUEST) -> JSONResponse:
    """A refused HTTP request (a WebRTC offer, a client secret), in OpenAI's error body (agents-js shows
    ``error.message``; the SDK raises on the status)."""
    return JSONResponse({"error": {"type": type, "code": code, "message": message, "param": None}}, status)
