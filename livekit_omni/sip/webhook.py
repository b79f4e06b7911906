"""The ``realtime.call.incoming`` webhook (OpenAI's call control): an INVITE is announced to the app at
``sip.webhook_url``, signed as Standard Webhooks sign (what the openai SDK's ``client.webhooks.unwrap()`` checks):

* ``webhook-id``: the event's id; ``webhook-timestamp``: Unix seconds; ``webhook-signature``: ``v1,`` and the base64
  HMAC-SHA256 of ``<id>.<timestamp>.<body>`` under the secret (``sip.webhook_secret``; a ``whsec_`` secret is the
  base64 of the key, any other string is the key itself, as the SDK reads it);
* the body: ``{"id", "object": "event", "created_at", "type": "realtime.call.incoming", "data": {"call_id",
  "sip_headers": [{"name", "value"}, ...], "sip_media_security": "rtp"}}``, the INVITE's headers in order without
  its credentials (``Authorization``, ``Proxy-Authorization``).

The app answers with ``POST /v1/realtime/calls/{call_id}/accept`` (or ``/reject``) within ``sip.accept_timeout_s``
(:mod:`livekit_omni.sip.routes`). A webhook that cannot be delivered (no connection, a non-2xx answer) refuses the
call at once (503 with Retry-After) rather than letting the caller ring out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from typing import Final

import aiohttp
from aiosipua.message import SipRequest

log = logging.getLogger(__name__)

#: How long the app's webhook endpoint may take to answer.
DELIVERY_TIMEOUT_S: Final = 10.0
#: INVITE headers never passed on.
SECRET_HEADERS: Final = frozenset({"authorization", "proxy-authorization"})


def secret_key(secret: str) -> bytes:
    """The HMAC key of a webhook secret, as the openai SDK derives it."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    if not key:
        raise ValueError("the webhook secret is empty")
    return key


def sign(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def sip_headers(invite: SipRequest) -> list[dict[str, str]]:
    """The INVITE's headers in order, credentials left out."""
    out: list[dict[str, str]] = []
    for name, values in invite.headers.items():
        if name.lower() in SECRET_HEADERS:
            continue
        out.extend({"name": name, "value": v} for v in values)
    return out


class Webhook:
    """Delivers ``realtime.call.incoming`` events to one URL."""

    def __init__(self, url: str, secret: str) -> None:
        self.url = url
        self.key = secret_key(secret)
        self._http: aiohttp.ClientSession | None = None
        self.delivered = 0
        self.failed = 0

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def event(self, call_id: str, invite: SipRequest) -> dict[str, object]:
        return {
            "id": "evt_" + secrets.token_hex(12),
            "object": "event",
            "created_at": int(time.time()),
            "type": "realtime.call.incoming",
            "data": {"call_id": call_id, "sip_headers": sip_headers(invite), "sip_media_security": "rtp"},
        }

    async def incoming(self, call_id: str, invite: SipRequest) -> bool:
        """Announce the call; True when the app's endpoint took it (2xx)."""
        event = self.event(call_id, invite)
        body = json.dumps(event, separators=(",", ":")).encode()
        ts = int(time.time())
        wid = str(event["id"])
        headers = {
            "Content-Type": "application/json",
            "webhook-id": wid,
            "webhook-timestamp": str(ts),
            "webhook-signature": sign(self.key, wid, ts, body),
            "User-Agent": "livekit-omni",
        }
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DELIVERY_TIMEOUT_S))
        try:
            async with self._http.post(self.url, data=body, headers=headers) as r:
                ok = 200 <= r.status < 300
                if not ok:
                    log.warning("sip webhook %s answered %d for call %s", self.url, r.status, call_id)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.warning("sip webhook %s failed for call %s: %s", self.url, call_id, e)
            ok = False
        if ok:
            self.delivered += 1
        else:
            self.failed += 1
        return ok
