"""Who may call: source addresses (``sip.allowed_sources``) and digest authentication (``sip.credentials``).

**Sources.** A request from an address outside every allowed network is answered 403 by the transport and goes
no further (``livekit_omni/sip/transport.py``). Empty: every source.

**Digest** (RFC 3261 §22, RFC 7616; what trunks and PBXs send when they register credentials with a carrier). With
credentials configured, a new INVITE without valid credentials gets 401 with a ``WWW-Authenticate`` challenge
(``Digest``, ``qop="auth"``, MD5 or SHA-256); the caller sends the INVITE again with an ``Authorization`` header,
which is checked here: the user is known, the nonce is ours and fresh, and the response is what the user's password
gives. The response is computed with aiosipua's own client-side digest (``build_credentials``), so both sides of
the exchange are one implementation. Nonces are stateless: ``<issue time>.<HMAC of it under a per-process
secret>``, valid ``NONCE_TTL_S``; nothing is stored per caller. In-dialog requests (re-INVITE, BYE) and OPTIONS
are not challenged: the dialog's tags and CSeq tie them to the authenticated INVITE, and a proxy's OPTIONS probes
carry no credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Final

from aiosipua.auth import SipDigestAuth, build_credentials
from aiosipua.headers import AuthChallenge, parse_auth
from aiosipua.message import SipRequest

#: How long a nonce we issued may be answered.
NONCE_TTL_S: Final = 300
ALGORITHMS: Final = ("MD5", "SHA-256")


def source_filter(cidrs: Iterable[str]) -> Callable[[str], bool] | None:
    """A check of a source address against ``cidrs`` (None when the list is empty: every source may call).
    Raises ValueError for a network that does not parse."""
    nets = [ipaddress.ip_network(c.strip(), strict=False) for c in cidrs]
    if not nets:
        return None

    def allowed(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in nets)

    return allowed


class DigestAuthenticator:
    """Challenges and checks ``Authorization: Digest`` on new INVITEs (see the module docstring)."""

    def __init__(self, users: dict[str, str], *, realm: str, algorithm: str = "MD5") -> None:
        if algorithm.upper() not in ALGORITHMS:
            raise ValueError(f"digest algorithm {algorithm!r} is not one of {ALGORITHMS}")
        self.users = dict(users)
        self.realm = realm
        self.algorithm = algorithm.upper()
        self._secret = secrets.token_bytes(32)

    def _sign(self, stamp: str) -> str:
        return hmac.new(self._secret, stamp.encode(), hashlib.sha256).hexdigest()[:32]

    def nonce(self, now: float | None = None) -> str:
        stamp = f"{int(now if now is not None else time.time()):x}"
        return f"{stamp}.{self._sign(stamp)}"

    def nonce_fresh(self, nonce: str, now: float | None = None) -> bool:
        stamp, _, mac = nonce.partition(".")
        if not stamp or not hmac.compare_digest(mac, self._sign(stamp)):
            return False
        try:
            issued = int(stamp, 16)
        except ValueError:
            return False
        age = (now if now is not None else time.time()) - issued
        return 0 <= age <= NONCE_TTL_S

    def challenge(self, *, stale: bool = False) -> str:
        """The ``WWW-Authenticate`` value of a 401."""
        value = f'Digest realm="{self.realm}", nonce="{self.nonce()}", algorithm={self.algorithm}, qop="auth"'
        return value + (", stale=true" if stale else "")

    def check(self, request: SipRequest) -> tuple[bool, bool]:
        """(authenticated, stale): whether ``request`` carries valid credentials, and whether they failed only
        because the nonce expired (the caller retries without asking its user again)."""
        raw = request.get_header("authorization")
        if not raw:
            return False, False
        try:
            given = parse_auth(raw)
        except Exception:
            return False, False
        p = {k.lower(): v for k, v in given.params.items()}
        if given.scheme.lower() != "digest" or p.get("realm") != self.realm:
            return False, False
        user, nonce, uri = p.get("username", ""), p.get("nonce", ""), p.get("uri", "")
        password = self.users.get(user)
        if password is None or not nonce or not uri:
            return False, False
        if (p.get("algorithm") or "MD5").upper() != self.algorithm:
            return False, False
        qop = (p.get("qop") or "").lower()
        if qop not in ("", "auth"):
            return False, False
        cnonce, nc = p.get("cnonce"), p.get("nc", "")
        challenge = AuthChallenge(
            scheme="Digest",
            params={
                "realm": self.realm,
                "nonce": nonce,
                "algorithm": self.algorithm,
                **({"qop": "auth"} if qop else {}),
            },
        )
        try:
            count = int(nc, 16) if qop else 1
        except ValueError:
            return False, False
        expected = build_credentials(
            SipDigestAuth(user, password),
            challenge,
            request.method.upper(),
            uri,
            nonce_count=count,
            cnonce=cnonce,
        )
        if expected is None or not hmac.compare_digest(expected.params["response"], p.get("response", "")):
            return False, False
        if not self.nonce_fresh(nonce):
            return False, True
        return True, False
