"""The Prometheus endpoint on the metrics port: collectors run at scrape time, in the daemon's event loop (so they
read executor state without locks)."""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def make_metrics_app(registry: CollectorRegistry) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", metrics)
    return app


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_metrics_app(registry), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
