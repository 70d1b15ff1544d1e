"""The plugin's own HTTP port (``EAAS_HTTP_PORT``), served from the vLLM worker process that
holds the dispatcher (vLLM's API server is another process).

Routes:

* ``PUT /routing-table`` / ``GET /routing-table``: the attention client's push endpoint and its
  acknowledgement, the same routes and answers (:mod:`eaas.runtime.client.table_push`: bearer
  token from ``EAAS_PUSH_TOKEN_FILE``, 401/403/409/400/413).
* ``GET /health``: 200 ``{"status": "ok", "routing_table_version", "servers", ...}``, or 503
  ``degraded`` while some expert has no live replica (a readiness probe takes the pod out).
* ``GET /metrics``: Prometheus exposition of this process (``eaas_dispatch_seconds``,
  ``eaas_failovers_total``, ``eaas_routing_table_version``, ``eaas_server_marked_down_total``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from eaas.runtime import metrics
from eaas.runtime.client.table_push import router as table_router

if TYPE_CHECKING:
    from eaas.vllm.client import ExpertClient


class HttpThread:
    """uvicorn on a daemon thread; :meth:`stop` ends it."""

    def __init__(self, server: uvicorn.Server):
        self.server = server
        self.thread = threading.Thread(target=server.run, name="eaas-vllm-http", daemon=True)

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def make_app(client: ExpertClient) -> FastAPI:
    """The FastAPI app of the port (see the module docstring)."""
    app = FastAPI(title="eaas.vllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.table_push = client.push
    app.include_router(table_router)

    @app.get("/health")
    async def health():
        status, body = await asyncio.to_thread(client.health)
        return JSONResponse(status_code=status, content=body)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render_latest(), media_type=metrics.CONTENT_TYPE_LATEST)

    return app


def start_http(client: ExpertClient, host: str, port: int, timeout: float = 30.0) -> HttpThread:
    """Serve :func:`make_app` on ``host:port`` and wait until it accepts connections.

    Raises:
        OSError: the port did not open within ``timeout`` seconds (taken, or not bindable).
    """
    config = uvicorn.Config(
        make_app(client), host=host, port=port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    t = HttpThread(server)
    t.thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not t.thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"eaas.vllm: EAAS_HTTP_PORT {host}:{port} did not open")
        time.sleep(0.02)
    return t
