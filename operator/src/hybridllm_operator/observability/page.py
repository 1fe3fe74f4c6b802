"""The built-in dashboard page, for those who have no Grafana.

Served beside ``/metrics`` on the operator's metrics address (and local mode's): ``/``
lists the LLMServices this process reconciles, ``/services/NAMESPACE/NAME`` shows one of
them with the panels of the Grafana dashboards (`panels`: the same definitions, the same
PromQL), and ``/api/v1/services/NAMESPACE/NAME/panels/DASHBOARD/INDEX`` answers one
panel's data. The data comes from the Prometheus the operator already reads demand from
(``--prometheus-url``): the page runs only the panels' own queries, with the service's
labels substituted, so it is not a proxy for arbitrary PromQL. Everything the browser
loads is in this package (page.html: inline CSS and JavaScript, SVG charts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridllm_operator.observability import panels
from hybridllm_operator.observability.metrics import OperatorMetrics, ServiceView, split_address

RANGES = {"5m": 300, "15m": 900, "1h": 3600, "6h": 21_600, "24h": 86_400}
POINTS = 200  # samples per series of a time-series panel
QUERY_TIMEOUT_S = 15.0
DASHBOARDS = {"service": panels.SERVICE, "autoscaling": panels.AUTOSCALING,
              "rollouts": panels.ROLLOUTS, "fleet": panels.FLEET}  # fmt: skip
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


class PanelError(Exception):
    """A request the page cannot answer: its HTTP status and a message naming why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Section:
    """One dashboard shown for one service, its variables bound."""

    key: str  # the API's dashboard name
    title: str
    values: dict[str, str]  # the dashboard's variables
    pool: str | None = None


def sections(view: ServiceView) -> list[Section]:
    """What the page of ``view`` shows: the service, each autoscaled pool, the rollout
    and, when its edge tier runs on devices, their fleet."""
    service = {"namespace": view.namespace, "llmservice": view.name}
    out = [Section("service", "Service", service)]
    for pool in sorted(view.scaling.scalers) if view.scaling is not None else []:
        out.append(Section("autoscaling", f"Autoscaling: {pool}", {**service, "pool": pool}, pool))
    out.append(Section("rollouts", "Rollout", service))
    devices = view.spec.edge.devices if view.spec is not None and view.spec.edge else None
    if devices is not None:
        out.append(Section("fleet", f"Edge fleet: {devices.fleet}", {"fleet": devices.fleet}))
    return out


def _legend(template: str, labels: dict[str, str]) -> str:
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def _number(raw: str) -> float | None:
    value = float(raw)
    return value if math.isfinite(value) else None


def window(range_s: int, rate_floor_s: float) -> tuple[int, str]:
    """The step of a range and the rate window its queries take: Grafana's
    ``$__rate_interval`` in spirit, at least four steps and never below the floor (at least
    two scrape intervals, the operator's ``prometheus_rate_window_seconds``)."""
    step = max(1, range_s // POINTS)
    return step, f"{max(math.ceil(rate_floor_s), 4 * step)}s"


class Page:
    """The page's routes over the services ``views`` lists and ``prometheus_url``."""

    def __init__(
        self, metrics: OperatorMetrics, prometheus_url: str | None, rate_floor_s: float = 60.0
    ) -> None:
        self.exported = metrics
        self.prometheus_url = prometheus_url.rstrip("/") if prometheus_url else None
        self.rate_floor_s = rate_floor_s
        self.template = resources.files(__package__).joinpath("page.html").read_text()
        self._session: ClientSession | None = None

    def standby(self) -> bool:
        return not self.exported.leading

    def standby_note(self) -> str:
        """What a standby's page says: that it is one, and who leads."""
        holder = self.exported.leader_is()
        return "this operator replica is a standby" + (
            f"; the leader is {holder}: open its page (port-forward to that pod)"
            if holder
            else ": open the leader's page"
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/", self.index)
        app.router.add_get("/services/{namespace}/{name}", self.service)
        app.router.add_get("/api/v1/services", self.services_json)
        app.router.add_get(
            "/api/v1/services/{namespace}/{name}/panels/{dashboard}/{index}", self.panel
        )
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ routes

    async def metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.exported.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _views(self) -> dict[tuple[str, str], ServiceView]:
        return {(v.namespace, v.name): v for v in self.exported.views()}

    def _view(self, request: web.Request) -> ServiceView:
        key = (request.match_info["namespace"], request.match_info["name"])
        view = self._views().get(key)
        if view is None:
            raise PanelError(404, self._unknown(*key))
        return view

    def _unknown(self, namespace: str, name: str) -> str:
        names = [f"{ns}/{n}" for ns, n in sorted(self._views())]
        known = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        known = known or "none"
        why = f" ({self.standby_note()})" if self.standby() else ""
        return f"no LLMService {namespace}/{name} here{why}; the services: {known}"

    async def index(self, _request: web.Request) -> web.Response:
        views = sorted(self._views().values(), key=lambda v: (v.namespace, v.name))
        items = "".join(
            f'<li><a href="services/{html.escape(v.namespace)}/{html.escape(v.name)}">'
            f"{html.escape(v.namespace)}/{html.escape(v.name)}</a></li>"
            for v in views
        )
        if not items:
            items = (
                "<li>"
                + (html.escape(self.standby_note()) if self.standby() else "no LLMService yet")
                + "</li>"
            )
        return self._html({"title": "hybridllm", "services": items})

    async def services_json(self, _request: web.Request) -> web.Response:
        return web.json_response([
            {"namespace": v.namespace, "name": v.name,
             "sections": [dataclasses.asdict(s) for s in sections(v)]}
            for v in sorted(self._views().values(), key=lambda v: (v.namespace, v.name))
        ])  # fmt: skip

    async def service(self, request: web.Request) -> web.Response:
        try:
            view = self._view(request)
        except PanelError as exc:
            return web.Response(status=exc.status, text=str(exc))
        config = {
            "namespace": view.namespace,
            "name": view.name,
            "prometheus": self.prometheus_url,
            "ranges": list(RANGES),
            "sections": [
                {"key": s.key, "title": s.title, "pool": s.pool,
                 "annotated": bool(DASHBOARDS[s.key].annotations),
                 "panels": [{"title": p.title, "description": p.description, "kind": p.kind,
                             "unit": p.unit, "band": p.band, "width": p.width}
                            for p in DASHBOARDS[s.key].panels]}
                for s in sections(view)
            ],
        }  # fmt: skip
        return self._html({
            "title": f"{view.namespace}/{view.name} · hybridllm",
            # </script> cannot occur in JSON that escapes "<"
            "config": json.dumps(config).replace("<", "\\u003c"),
        })  # fmt: skip

    def _html(self, values: dict[str, str]) -> web.Response:
        page = self.template
        for key in ("title", "services", "config"):
            text = values.get(key, "" if key != "config" else "null")
            page = page.replace("{{" + key + "}}", html.escape(text) if key == "title" else text)
        return web.Response(text=page, content_type="text/html")

    async def panel(self, request: web.Request) -> web.Response:
        try:
            body = await self._panel(request)
        except PanelError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return web.json_response(body)

    async def _panel(self, request: web.Request) -> dict[str, Any]:
        view = self._view(request)
        key, index = request.match_info["dashboard"], request.match_info["index"]
        q = request.query
        unknown = sorted(set(q) - {"range", "pool"})
        if unknown:
            raise PanelError(400, f"unknown parameter {unknown[0]!r}: range and pool are taken")
        range_name = q.get("range", "1h")
        if range_name not in RANGES:
            raise PanelError(400, f"range {range_name!r} is not one of {', '.join(RANGES)}")
        candidates = [s for s in sections(view) if s.key == key]
        if not candidates:
            shown = ", ".join(dict.fromkeys(s.key for s in sections(view)))
            raise PanelError(404, f"{view.name} shows no dashboard {key!r}; it shows {shown}")
        if key == "autoscaling":
            pools = ", ".join(str(s.pool) for s in candidates)
            if "pool" not in q:
                raise PanelError(400, f"the autoscaling dashboard needs pool: one of {pools}")
            section = next((s for s in candidates if s.pool == q["pool"]), None)
            if section is None:
                raise PanelError(400, f"pool {q['pool']!r} is not one of {pools}")
        elif "pool" in q:
            raise PanelError(400, f"pool applies to the autoscaling dashboard, not {key!r}")
        else:
            section = candidates[0]
        dashboard = DASHBOARDS[key]
        if index == "annotations":
            queries, kind = dashboard.annotations, "annotations"
        else:
            if not index.isdigit() or int(index) >= len(dashboard.panels):
                raise PanelError(
                    404,
                    f"the {key} dashboard has panels 0 to {len(dashboard.panels) - 1}, not {index!r}",
                )
            panel = dashboard.panels[int(index)]
            queries, kind = panel.queries, panel.kind
        if self.prometheus_url is None:
            raise PanelError(
                503,
                "no Prometheus to query: start the operator with --prometheus-url "
                "(HYBRIDLLM_OPERATOR_PROMETHEUS_URL; `hybridllm up --prometheus-url` in local mode)",
            )
        range_s = RANGES[range_name]
        step, rate = window(range_s, self.rate_floor_s)
        end = time.time()
        series: list[dict[str, Any]] = []
        exprs: list[str] = []
        for query in queries:
            expr = panels.render(query.expr, section.values, rate=rate, range_=f"{range_s}s")
            exprs.append(expr)
            if kind in ("timeseries", "annotations"):
                result = await self._prometheus(
                    "query_range",
                    {"query": expr, "start": end - range_s, "end": end, "step": step},
                )
                for item in result:
                    points = [[t, _number(v)] for t, v in item.get("values", [])]
                    series.append(
                        {"legend": _legend(query.legend, item["metric"]), "points": points}
                    )
            else:
                result = await self._prometheus("query", {"query": expr, "time": end})
                for item in result:
                    t, v = item["value"]
                    series.append(
                        {
                            "legend": _legend(query.legend, item["metric"]),
                            "points": [[t, _number(v)]],
                        }
                    )
        return {"kind": kind, "queries": exprs, "series": series, "start": end - range_s,
                "end": end, "step": step}  # fmt: skip

    async def _prometheus(self, api: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=QUERY_TIMEOUT_S))
        url = f"{self.prometheus_url}/api/v1/{api}"
        try:
            async with self._session.get(url, params={k: str(v) for k, v in params.items()}) as r:
                text = await r.text()
        except (TimeoutError, ClientError) as exc:
            raise PanelError(
                502, f"Prometheus at {self.prometheus_url} did not answer: {exc!r}"
            ) from exc
        try:
            body = json.loads(text)
        except ValueError:
            raise PanelError(
                502, f"Prometheus answered {r.status} with no JSON: {text[:200]!r}"
            ) from None
        if body.get("status") != "success":
            raise PanelError(
                502, f"Prometheus refused {params['query']!r}: {body.get('error', text[:200])}"
            )
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])


def serve(
    metrics: OperatorMetrics,
    address: str,
    prometheus_url: str | None = None,
    rate_floor_s: float = 60.0,
) -> Callable[[], None]:
    """Serve ``/metrics`` and the page on ``host:port`` from a thread of its own (its own
    event loop: a busy control loop never delays a scrape); returns the function that
    stops it. Raises OSError when the address cannot be bound, ValueError for a bad one."""
    host, port = split_address(address)
    page = Page(metrics, prometheus_url, rate_floor_s)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(page.app(), access_log=None)

    async def start() -> None:
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise

    started: list[BaseException | None] = []
    ready = threading.Event()

    def run() -> None:  # the whole life of the loop in this thread: safe beside any other
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
            started.append(None)
        except (OSError, RuntimeError) as exc:  # handed to the caller
            started.append(exc)
        ready.set()
        if started[0] is None:
            loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="metrics-page", daemon=True)
    thread.start()
    ready.wait()
    if started[0] is not None:
        thread.join()
        raise started[0]

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

    return stop
