"""The Prometheus endpoint on the metrics port: collectors run at scrape time, in the daemon's event loop (so they
read executor state without locks).

The body is `generate_latest(registry)` followed by the text of each `text_sources` entry: exporters that write their
own exposition because prometheus_client's would be too slow for them (gpud/telemetry/model_metrics.py: ~11 000 samples
for 100 models). Such a source must not also be registered in `registry`, or its families would appear twice.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class TextSource(Protocol):
    """Writes its families in the Prometheus text format (e.g. gpud.telemetry.model_metrics.ModelMetrics)."""

    registry: CollectorRegistry | None  # the registry it is registered in as a collector, if any

    def render_text(self) -> str: ...


def check_sources(registry: CollectorRegistry, text_sources: Sequence[TextSource]) -> None:
    for source in text_sources:
        if source.registry is registry:
            raise ValueError(f"{type(source).__name__} is registered in the served registry and given as a text "
                             "source: its families would be exported twice (create it with registry=None)")


def exposition(registry: CollectorRegistry, text_sources: Sequence[TextSource] = ()) -> bytes:
    """What one scrape answers: the registry's collectors, then the text sources."""
    body = generate_latest(registry)
    if text_sources:
        body += "".join(source.render_text() for source in text_sources).encode("utf-8")
    return body


def make_metrics_app(registry: CollectorRegistry, text_sources: Sequence[TextSource] = ()) -> web.Application:
    check_sources(registry, text_sources)
    sources = tuple(text_sources)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=exposition(registry, sources), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", metrics)
    return app


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                               text_sources: Sequence[TextSource] = ()) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(make_metrics_app(registry, text_sources), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]  # the site's first socket: (host, port[, flowinfo, scope_id])
