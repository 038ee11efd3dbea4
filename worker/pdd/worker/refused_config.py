"""A worker whose engine settings this machine refuses: it stays up, not ready, and says why.

Some settings only the node can judge (``device: cuda`` in a pod that sees no GPU, a
KV cache larger than the node's memory). A worker that exited on them
would crash-loop (CrashLoopBackOff): restarts forever, each hiding the reason a little
deeper in a previous container's log, while nothing in the pod's state says what to
change. Instead the worker stays up and serves only this: ``/ready`` answers 503 with the
reason (readiness probes use it, so the pod is never restarted and never joins its
Service; ``kubectl describe pod`` shows it running, not ready, with no restarts),
``/health`` answers 503 with the reason as JSON, ``/metrics`` has
``pdd_worker_config_refused 1``, and its log says it once, in one line (``kubectl logs``,
the current container's). SIGTERM or SIGINT ends it with code 0, like any pod removed.
"""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdd.common.wire import WorkerRefusal
from pdd.worker.roles.protocol import split_addr

log = logging.getLogger("pdd.worker")


#: What a refusal is about and where that is set: (what, where).
ENGINE_SETTINGS = (
    "engine settings refused on this machine",
    "set in the PDDDeployment's spec.engine or the role's engine, or the worker flag of that name",
)
WAN_TLS_FILES = (
    "WAN TLS files refused",
    "the Secret of spec.wan.tls: its secretName, else the operator's <name>-wan-tls; or the "
    "--wan-tls-dir flag",
)


def log_line(refusal: WorkerRefusal, http: str, about: tuple[str, str] = ENGINE_SETTINGS) -> str:
    what, where = about
    return (
        f"{refusal.role} {refusal.instance_id}: {what}: {refusal.problem} ({where}). Not "
        f"exiting, which would crash-loop: serving /ready 503 with this reason on {http} "
        "until stopped"
    )


def refused_registry() -> CollectorRegistry:
    """The one metric a refused worker exports (its whole ``/metrics``)."""
    registry = CollectorRegistry()
    Gauge(
        "pdd_worker_config_refused",
        "1: this worker's engine settings are refused on this machine; it serves nothing",
        registry=registry,
    ).set(1)
    return registry


def create_refused_app(refusal: WorkerRefusal) -> FastAPI:
    """``/ready``, ``/health`` and ``/metrics`` say the refusal; ``/startup`` and ``/live``
    answer 200 (a restart would not help); every other path is 503 too."""
    app = FastAPI(title=f"pdd worker ({refusal.role}, settings refused)")
    metrics = generate_latest(refused_registry())  # fixed from now on: render it once

    # Started and live, never ready: a restart would refuse the same settings again.
    @app.get("/startup")
    async def startup() -> PlainTextResponse:
        return PlainTextResponse("started (settings refused)\n")

    @app.get("/live")
    async def live() -> PlainTextResponse:
        return PlainTextResponse("live (settings refused)\n")

    @app.get("/ready")
    async def ready() -> PlainTextResponse:
        return PlainTextResponse(f"not ready: {refusal.problem}\n", status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(refusal.model_dump(), status_code=503)

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics, media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def anything_else(path: str) -> JSONResponse:
        # The control API's error shape: a router or peer that reaches it learns why.
        error = {"type": refusal.status, "message": f"engine settings refused: {refusal.problem}"}
        return JSONResponse({"error": error}, status_code=503)

    return app


class _Server(uvicorn.Server):
    """uvicorn, except that a stop signal is not raised again once the server has shut
    down (uvicorn's default, which would end the process by that signal, not with 0)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.force_exit = self.should_exit  # a second signal: stop without waiting
        self.should_exit = True


async def serve_refused(
    refusal: WorkerRefusal, http: str, about: tuple[str, str] = ENGINE_SETTINGS
) -> None:
    """Log the refusal once and serve ``create_refused_app`` on ``http`` (HOST:PORT) until
    SIGTERM or SIGINT."""
    log.error("%s", log_line(refusal, http, about))
    host, port = split_addr(http)
    app = create_refused_app(refusal)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    await _Server(config).serve()
