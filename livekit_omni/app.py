"""The HTTP/WebSocket application: /health, /v1/models, /v1/chat/completions, /metrics, the static frontend, and
the Live and Realtime facade routes.

Auth (:mod:`livekit_omni.auth`): with API keys configured, every endpoint but /health and the static page needs
``Authorization: Bearer``; HTTP requests without a valid key get 401, WebSocket upgrades are checked by the facade.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from engine_bridge.protocol import EngineState
from livekit_omni import routing, worker_ids
from livekit_omni.auth import AuthMiddleware
from livekit_omni.chat import routes as chat_routes
from livekit_omni.drain import Drain
from livekit_omni.live.routes import routes as live_routes
from livekit_omni.metrics import Metrics
from livekit_omni.realtime.routes import routes as realtime_routes
from livekit_omni.sessions.hub import hub_of
from livekit_omni.settings import Settings
from livekit_omni.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

FRONTEND_DIR = Path(__file__).resolve().parent.parent / "frontend"


async def health(request: Request) -> Response:
    sup: EngineSupervisor = request.app.state.supervisor
    await sup.refresh()
    body = sup.health()
    body["uptime_s"] = round(time.monotonic() - request.app.state.started_at, 1)
    ident = worker_ids.current()
    if ident is not None:
        body["worker"] = {"index": ident.index, "count": ident.count}
    sip = getattr(request.app.state, "sip", None)
    if sip is not None:
        body["sip"] = sip.stats()
    drain: Drain = request.app.state.drain
    if not drain.admitting:
        # 503 takes a draining server out of a load balancer's rotation; open sessions still run.
        body["status"] = str(drain.status)
        body["drain_remaining_s"] = round(drain.remaining_s() or 0.0, 1)
        return JSONResponse(body, status_code=503)
    return JSONResponse(body, status_code=200 if sup.state is EngineState.READY else 503)


async def models(request: Request) -> Response:
    """The server's model, and the engine's thinker (what /v1/chat/completions runs on) with its context size."""
    settings: Settings = request.app.state.settings
    sup: EngineSupervisor = request.app.state.supervisor
    data: list[dict[str, object]] = [
        {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "livekit-omni"}
    ]
    thinker = sup.engine_info.get("thinker")
    if isinstance(thinker, dict) and thinker.get("model"):
        data.append(
            {
                "id": Path(str(thinker["model"])).name,
                "object": "model",
                "created": 0,
                "owned_by": "livekit-omni",
                "max_model_len": thinker.get("max_model_len"),
                "backend": thinker.get("backend"),
            }
        )
    return JSONResponse({"object": "list", "data": data})


async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    sup: EngineSupervisor = request.app.state.supervisor
    m.engine_restarts.set(sup.restarts)

    async def local() -> str:
        return generate_latest(m.registry).decode()

    if not routing.is_relayed_request(request.scope):
        # Several workers: one scrape shows them all, each sample labelled with its worker.
        merged = await routing.gather_metrics(request.app, local, request.headers.get("authorization", ""))
        if merged is not None:
            return Response(merged, media_type=CONTENT_TYPE_LATEST)
    return PlainTextResponse(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


async def index(request: Request) -> Response:
    page = FRONTEND_DIR / "index.html"
    if not page.is_file():
        return PlainTextResponse("livekit-omni: the frontend is not installed", status_code=404)
    return FileResponse(page)


def create_app(settings: Settings, *, supervisor: EngineSupervisor | None = None) -> Starlette:
    sup = supervisor or EngineSupervisor(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not settings.api_keys:
            log.warning("no API keys configured: every endpoint is open (fine for local use only)")
        sip = None
        if settings.sip.enabled:
            from livekit_omni.sip.server import SipServer

            sip = SipServer(hub_of(app), settings)  # checks the SIP settings before anything starts
        await sup.start()
        if sip is not None:
            try:
                await sip.start()
            except BaseException:
                await sup.stop()
                raise
            app.state.sip = sip
        try:
            yield
        finally:
            closer = getattr(app.state, "close_sessions", None)
            if closer is not None:
                await closer()
            if sip is not None:
                await sip.stop()
            await sup.stop()
            if relay is not None:
                await relay.close()

    metrics_ = Metrics()
    ident = worker_ids.current()
    relay = routing.Relay(ident, metrics_) if ident is not None else None
    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/models", models),
        Route("/metrics", metrics),
        Route("/", index),
    ]
    routes += live_routes()
    routes += chat_routes()
    if settings.sip.enabled:
        from livekit_omni.sip.routes import routes as sip_routes

        routes += sip_routes()  # before the Realtime dialect's: /hangup reaches SIP calls first
    routes += realtime_routes()
    if FRONTEND_DIR.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=FRONTEND_DIR), name="static"))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            # Outermost: a request for another worker's session goes there before anything here looks at it.
            *([Middleware(routing.WorkerRouter, relay=relay)] if relay is not None else []),
            Middleware(
                CORSMiddleware,
                allow_origins=settings.cors_origins,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
            ),
            Middleware(AuthMiddleware, settings=settings),
        ],
    )
    app.state.settings = settings
    app.state.supervisor = sup
    app.state.metrics = metrics_
    app.state.started_at = time.monotonic()
    app.state.drain = Drain(settings.drain_grace_s)
    app.state.relay = relay
    return app


async def drain_app(app: Starlette) -> int:
    """SIGTERM: stop admission, let open sessions run up to the grace, close the rest (see livekit_omni.drain)."""
    hub = hub_of(app)
    drain: Drain = app.state.drain
    drain.begin()
    await hub.end_detached()  # no client to finish them; a detach from now on ends the session instead
    return await drain.run(hub.held, hub.close_all)
