"""The control channel: length-prefixed msgpack frames of :mod:`engine_bridge.protocol` over a local socket.

* :class:`ControlServer` (engine side) decodes commands and hands each to a handler. A frame that fails to
  decode is answered with an ``ErrorReply(code="bad_message")`` and a log line; the connection survives.
* :class:`ControlClient` (serving side) sends commands, matches replies by ``req_id`` with a timeout, and hands
  session events to a callback. When the connection drops, every pending request fails with
  :class:`EngineLostError` and the ``on_lost`` callback runs once.

Addresses: ``unix:/path/to.sock`` (or a bare path) for a Unix socket, ``tcp:HOST:PORT`` (or ``HOST:PORT``) for TCP
on loopback, for setups where the engine sits in another container on the same host (the rings still need a
shared /dev/shm).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import msgspec

from engine_bridge import protocol as p

log = logging.getLogger(__name__)

MAX_FRAME_BYTES: Final = 1 << 20
#: Error replies and log lines quote at most this much of a decoder's message (msgspec quotes the bad value, which
#: can be most of a 1 MiB frame: the reply would not fit in a frame, and the log would fill up).
MAX_ERROR_CHARS: Final = 300
#: What msgspec raises for bytes that are not a command: bad msgpack, bad types, nesting deeper than the recursion
#: limit (RecursionError), and strings that are not UTF-8 (UnicodeDecodeError).
_UNDECODABLE: Final = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
_LEN = struct.Struct(">I")

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(p.Command)
_engine_decoder = msgspec.msgpack.Decoder(p.EngineMessage)


class ControlError(RuntimeError):
    pass


class EngineLostError(ControlError):
    """The engine connection closed or the engine died."""


class RequestTimeout(ControlError):
    pass


class UnexpectedReply(ControlError):
    """The engine answered a command with a result of another command's type (a protocol bug)."""


class EngineRequestError(ControlError):
    """The engine answered a command with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Address:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> Address:
        if text.startswith("unix:"):
            return cls("unix", path=text[5:])
        if text.startswith("tcp:"):
            text = text[4:]
        elif "/" in text:
            return cls("unix", path=text)
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"engine address {text!r}: use unix:/path/to.sock or tcp:HOST:PORT")
        return cls("tcp", host=host or "127.0.0.1", port=int(port))

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.host}:{self.port}"


def encode(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME_BYTES:
        raise ControlError(f"control message of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(4)
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ControlError(f"control frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return await reader.readexactly(n)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + f"... ({len(text)} chars)"


def _salvage_req_id(body: bytes) -> int:
    """Best effort: the req_id of a frame that did not decode as a command, so the error reply can be matched."""
    try:
        raw = msgspec.msgpack.decode(body)
    except _UNDECODABLE:
        return 0
    if isinstance(raw, dict) and isinstance(raw.get("req_id"), int):
        return int(raw["req_id"])
    return 0


# --- engine side ------------------------------------------------------------------------------------------------


class ServerConnection:
    """One client of the engine. ``send`` never blocks the engine on a slow client beyond the socket buffer."""

    _ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.id = next(self._ids)
        self.reader = reader
        self.writer = writer
        self.closed = False
        self.client = ""
        self.pid = 0

    def send(self, msg: msgspec.Struct) -> None:
        if self.closed:
            return
        try:
            frame = encode(msg)
        except ControlError as e:
            # Too large for a frame (an error quoting a huge value, say). The connection stays usable: an error
            # reply is clipped, another reply becomes an error reply, an event is dropped.
            log.error("control connection %d: %s", self.id, e)
            req_id = getattr(msg, "req_id", None)
            if req_id is None:
                return
            message = (
                msg.message if isinstance(msg, p.ErrorReply) else f"the {type(msg).__name__} was too large"
            )
            code = msg.code if isinstance(msg, p.ErrorReply) else p.ErrorCode.INTERNAL
            frame = encode(p.ErrorReply(req_id=req_id, code=code, message=_clip(message)))
        try:
            self.writer.write(frame)
        except (ConnectionError, RuntimeError) as e:
            log.debug("control connection %d: send failed: %s", self.id, e)
            self.closed = True


CommandHandler = Callable[[ServerConnection, p.Command], Awaitable[p.Reply | p.ErrorReply]]
ConnectionHook = Callable[[ServerConnection], None]


class ControlServer:
    def __init__(
        self,
        address: Address,
        handler: CommandHandler,
        *,
        on_disconnect: ConnectionHook | None = None,
    ) -> None:
        self.address = address
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._server: asyncio.Server | None = None
        self.connections: set[ServerConnection] = set()
        self.bad_messages = 0

    async def start(self) -> None:
        if self.address.kind == "unix":
            path = Path(self.address.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket from a dead engine
            # Owner-only from the moment it exists: bound under a umask that leaves no group/other bits (a chmod
            # after bind would leave a window in which another local user could connect).
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(path))
            except BaseException:
                sock.close()
                raise
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        else:
            self._server = await asyncio.start_server(self._serve, self.address.host, self.address.port)
            if self.address.port == 0:
                port = self._server.sockets[0].getsockname()[1]
                self.address = Address("tcp", host=self.address.host, port=port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        if self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                Path(self.address.path).unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ServerConnection(reader, writer)
        self.connections.add(conn)
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    body = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                except ControlError as e:
                    # An oversized length prefix: we cannot resynchronise the stream, so answer and hang up.
                    log.warning("control connection %d: %s; closing it", conn.id, e)
                    conn.send(p.ErrorReply(req_id=0, code=p.ErrorCode.BAD_MESSAGE, message=str(e)))
                    break
                try:
                    cmd = _command_decoder.decode(body)
                except _UNDECODABLE as e:
                    self.bad_messages += 1
                    req_id = _salvage_req_id(body)
                    why = _clip(f"{type(e).__name__}: {e}")
                    log.warning(
                        "control connection %d: undecodable command (req_id=%d): %s", conn.id, req_id, why
                    )
                    conn.send(p.ErrorReply(req_id=req_id, code=p.ErrorCode.BAD_MESSAGE, message=why))
                    continue
                # One task per command keeps a slow command from stalling the connection; handlers post into
                # session mailboxes before their first await, so per-session order is the arrival order.
                task = asyncio.create_task(self._handle(conn, cmd))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            conn.closed = True
            self.connections.discard(conn)
            for task in tasks:
                task.cancel()
            writer.close()
            if self._on_disconnect is not None:
                try:
                    self._on_disconnect(conn)
                except Exception:
                    log.exception("on_disconnect hook failed")

    async def _handle(self, conn: ServerConnection, cmd: p.Command) -> None:
        try:
            reply = await self._handler(conn, cmd)
        except Exception as e:  # a bug in one command must not take the connection down
            log.exception("control command %s failed", type(cmd).__name__)
            reply = p.ErrorReply(
                req_id=cmd.req_id, code=p.ErrorCode.INTERNAL, message=_clip(f"{type(e).__name__}: {e}")
            )
        conn.send(reply)


# --- serving side -----------------------------------------------------------------------------------------------

EventCallback = Callable[[p.SessionEvent | p.TextEvent], None]
R = TypeVar("R", bound=p.ReplyResult)


def result_as(reply: p.Reply, cmd: p.Command, result_type: type[R]) -> R:
    """The reply's result as ``result_type``; raises :class:`UnexpectedReply` when it is another result."""
    result = reply.result
    if not isinstance(result, result_type):
        raise UnexpectedReply(
            f"{type(cmd).__name__} was answered with {type(result).__name__}, not {result_type.__name__}"
        )
    return result


class ControlClient:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        on_event: EventCallback,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._on_event = on_event
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.Reply]] = {}
        self.closed = False
        #: The engine's health as it answered Hello (set by :meth:`connect`).
        self.hello: p.EngineHealth | None = None
        self._read_task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        address: Address | str,
        *,
        on_event: EventCallback,
        on_lost: Callable[[], None] | None = None,
        timeout: float = 5.0,
        client_name: str = "",
    ) -> ControlClient:
        addr = Address.parse(address) if isinstance(address, str) else address
        if addr.kind == "unix":
            opener = asyncio.open_unix_connection(addr.path)
        else:
            opener = asyncio.open_connection(addr.host, addr.port)
        try:
            reader, writer = await asyncio.wait_for(opener, timeout)
        except (OSError, TimeoutError) as e:
            raise EngineLostError(f"cannot reach the engine at {addr}: {e}") from e
        client = cls(reader, writer, on_event=on_event, on_lost=on_lost)
        client.hello = await client.call(
            p.Hello(req_id=0, client=client_name, pid=os.getpid()), p.EngineHealth, timeout=timeout
        )
        return client

    def next_id(self) -> int:
        return next(self._ids)

    async def request(self, cmd: p.Command, *, timeout: float = 5.0) -> p.Reply:
        """Send ``cmd`` (its ``req_id`` is assigned here) and wait for its reply."""
        if self.closed:
            raise EngineLostError("the engine connection is closed")
        cmd.req_id = self.next_id()
        fut: asyncio.Future[p.Reply] = asyncio.get_running_loop().create_future()
        self._pending[cmd.req_id] = fut
        try:
            self._writer.write(encode(cmd))
            await self._writer.drain()
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            raise RequestTimeout(f"{type(cmd).__name__} got no reply within {timeout:.1f} s") from e
        except ConnectionError as e:
            raise EngineLostError(f"engine connection failed: {e}") from e
        finally:
            self._pending.pop(cmd.req_id, None)

    async def call(self, cmd: p.Command, result_type: type[R], *, timeout: float = 5.0) -> R:
        """:meth:`request`, returning the reply's result decoded as ``result_type`` (``p.RESULT_OF[type(cmd)]``)."""
        return result_as(await self.request(cmd, timeout=timeout), cmd, result_type)

    def send_raw(self, frame: bytes) -> None:
        """Write pre-encoded bytes (tests use it to send undecodable frames)."""
        self._writer.write(_LEN.pack(len(frame)) + frame)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._read_task

    async def _read_loop(self) -> None:
        try:
            while True:
                body = await read_frame(self._reader)
                try:
                    msg = _engine_decoder.decode(body)
                except _UNDECODABLE as e:
                    log.warning("undecodable message from the engine: %s", _clip(str(e)))
                    continue
                if isinstance(msg, p.Reply | p.ErrorReply):
                    fut = self._pending.get(msg.req_id)
                    if fut is None or fut.done():
                        if isinstance(msg, p.ErrorReply):
                            log.warning(
                                "engine error for unknown request %d: %s %s",
                                msg.req_id,
                                msg.code,
                                msg.message,
                            )
                        continue
                    if isinstance(msg, p.ErrorReply):
                        fut.set_exception(EngineRequestError(msg.code, msg.message))
                    else:
                        fut.set_result(msg)
                else:
                    try:
                        self._on_event(msg)
                    except Exception:
                        log.exception("session event handler failed")
        except (asyncio.IncompleteReadError, ConnectionError, ControlError):
            pass
        finally:
            self.closed = True
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(EngineLostError("the engine connection closed"))
            self._pending.clear()
            if self._on_lost is not None:
                try:
                    self._on_lost()
                except Exception:
                    log.exception("on_lost hook failed")
