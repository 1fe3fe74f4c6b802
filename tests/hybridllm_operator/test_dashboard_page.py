"""The built-in dashboard page: the operator's metrics server with a real autoscaler's
decisions, scraped by a real Prometheus, its panel API answering the dashboards' own
queries, its refusals, and the page itself in headless Chromium."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import start_http_server

from hybridllm_common import crd
from hybridllm_operator.edgefleet import metrics as fleet_metrics
from hybridllm_operator.local.plan import free_ports
from hybridllm_operator.observability import metrics as control_metrics
from hybridllm_operator.observability import page, panels

from . import browser
from .conftest import Kube, scaled_service

PAGE = Path(page.__file__).with_name("page.html")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(testenv: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The page and /metrics of an operator that leads and holds one scaled service, a
    real Prometheus scraping that /metrics every second."""
    views = [scaled_service()]
    exported = control_metrics.OperatorMetrics(lambda: views)
    exported.lead(True)
    state = tmp_path_factory.mktemp("prometheus")
    prometheus = testenv.prometheus_up(state)
    port = free_ports(1)[0]
    stop = page.serve(exported, f"127.0.0.1:{port}", prometheus, rate_floor_s=4)
    try:
        testenv.prometheus_targets(state, [(f"127.0.0.1:{port}", {})])
        yield {
            "url": f"http://127.0.0.1:{port}", "view": views[0], "prometheus": prometheus,
            "state": state, "targets": [(f"127.0.0.1:{port}", {})],
        }  # fmt: skip
    finally:
        stop()
        testenv.stop(state, "prometheus")


def _panel(served: dict[str, Any], dashboard: str, title: str, **params: str) -> httpx.Response:
    index = next(i for i, p in enumerate(page.DASHBOARDS[dashboard].panels) if p.title == title)
    return httpx.get(
        f"{served['url']}/api/v1/services/ns/svc/panels/{dashboard}/{index}",
        params=params,
        timeout=30,
    )


def test_the_page_lists_the_services_and_serves_the_metrics(served: dict[str, Any]) -> None:
    index = httpx.get(served["url"] + "/", timeout=10)
    assert index.status_code == 200
    assert '<a href="services/ns/svc">ns/svc</a>' in index.text
    scrape = httpx.get(served["url"] + "/metrics", timeout=10)
    assert scrape.headers["content-type"].startswith("text/plain")
    assert "hybridllm_operator_leader 1.0" in scrape.text
    assert 'hybridllm_autoscaler_desired_replicas{llmservice="svc",namespace="ns",pool="edge"}' in (
        scrape.text
    )
    listed = httpx.get(served["url"] + "/api/v1/services", timeout=10).json()
    assert [(s["namespace"], s["name"]) for s in listed] == [("ns", "svc")]
    assert [(s["key"], s["pool"]) for s in listed[0]["sections"]] == [
        ("service", None), ("autoscaling", "edge"), ("rollouts", None),
    ]  # fmt: skip


def test_a_panel_answers_with_the_dashboards_own_query_from_prometheus(
    served: dict[str, Any],
) -> None:
    desired = served["view"].scaling.desired["edge"]

    def answered() -> dict[str, Any] | None:
        body = _panel(served, "autoscaling", "Replicas: desired, provisioned, ready",
                      pool="edge", range="5m").json()  # fmt: skip
        series = {s["legend"]: s for s in body["series"]}
        got = [p[1] for p in series.get("desired", {}).get("points", []) if p[1] is not None]
        return body if got else None

    body = Kube.eventually(answered, what="Prometheus to hold the desired replicas")
    series = {s["legend"]: s for s in body["series"]}
    assert [p[1] for p in series["desired"]["points"] if p[1] is not None][-1] == desired
    panel = next(p for p in panels.AUTOSCALING.panels if p.title.startswith("Replicas: desired"))
    step, rate = page.window(300, 4)
    # the panel's own PromQL, the variables bound, the 5 m range's step and rate window
    assert body["queries"] == [
        panels.render(q.expr, {"namespace": "ns", "llmservice": "svc", "pool": "edge"}, rate)
        for q in panel.queries
    ]
    assert body["step"] == step
    assert body["end"] - body["start"] == 300
    # an instant panel (a table) answers one point per series
    table = _panel(served, "autoscaling", "Why: the last decision", pool="edge").json()
    causes = [
        s for s in table["series"] if s["legend"] == served["view"].scaling.decisions["edge"].cause
    ]
    assert table["kind"] == "table"
    assert causes
    assert causes[0]["points"][0][1] == 1


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("ns/other/panels/service/0", 404, "no LLMService ns/other here; the services: ns/svc"),
        (
            "ns/svc/panels/fleet/0",
            404,
            "svc shows no dashboard 'fleet'; it shows service, autoscaling, rollouts",
        ),
        ("ns/svc/panels/service/99", 404, "the service dashboard has panels 0 to 7, not '99'"),
        ("ns/svc/panels/service/0?range=2d", 400, "range '2d' is not one of 5m, 15m, 1h, 6h, 24h"),
        ("ns/svc/panels/autoscaling/0?pool=decode", 400, "pool 'decode' is not one of edge"),
        ("ns/svc/panels/autoscaling/0", 400, "the autoscaling dashboard needs pool: one of edge"),
        ("ns/svc/panels/service/0?pool=edge", 400, "pool applies to the autoscaling dashboard"),
        ("ns/svc/panels/service/0?query=up", 400, "unknown parameter 'query'"),
    ],
)
def test_a_bad_panel_request_is_refused_naming_the_problem(
    served: dict[str, Any], path: str, status: int, message: str
) -> None:
    r = httpx.get(f"{served['url']}/api/v1/services/{path}", timeout=10)
    assert r.status_code == status
    assert message in r.json()["error"]


def test_without_a_reachable_prometheus_the_panels_say_why() -> None:
    exported = control_metrics.OperatorMetrics(lambda: [scaled_service()])
    for prometheus, status, message in (
        (None, 503, "no Prometheus to query: start the operator with --prometheus-url"),
        (f"http://127.0.0.1:{free_ports(1)[0]}", 502, "did not answer"),
    ):
        port = free_ports(1)[0]
        stop = page.serve(exported, f"127.0.0.1:{port}", prometheus)
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/services/ns/svc/panels/service/0")
        finally:
            stop()
        assert r.status_code == status
        assert message in r.json()["error"]


def test_a_standby_says_so_and_a_taken_port_is_refused() -> None:
    exported = control_metrics.OperatorMetrics()  # a standby holds no service
    port = free_ports(1)[0]
    stop = page.serve(exported, f"127.0.0.1:{port}", None)
    try:
        assert "this operator replica is a standby" in httpx.get(f"http://127.0.0.1:{port}/").text
        r = httpx.get(f"http://127.0.0.1:{port}/services/ns/svc")
        assert r.status_code == 404
        assert "standby" in r.text
        assert "hybridllm_operator_leader 0.0" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        with pytest.raises(OSError, match="address already in use"):
            page.serve(exported, f"127.0.0.1:{port}", None)
    finally:
        stop()


def test_the_page_loads_nothing_from_outside_the_package() -> None:
    """The only absolute URL in the page is the SVG namespace (a name, never fetched); no
    stylesheet or script is imported. The browser test checks what is actually fetched."""
    text = PAGE.read_text()
    assert set(re.findall(r"[a-z]+://[^\s\"'`)]+", text)) == {"http://www.w3.org/2000/svg"}
    assert "@import" not in text
    assert re.search(r"<script[^>]*\bsrc=", text) is None
    assert re.search(r"<link[^>]*\bstylesheet", text) is None


def test_the_page_in_a_real_browser_draws_the_control_plane_panels(served: dict[str, Any]) -> None:
    """Headless Chromium: every panel of every section drawn, none failing, the
    autoscaling panels the operator feeds holding data; no console message."""
    Kube.eventually(lambda: _panel(
        served, "autoscaling", "Replicas: desired, provisioned, ready", pool="edge", range="5m",
    ).json()["series"], what="Prometheus to hold the desired replicas")  # fmt: skip
    loaded = browser.load(served["url"] + "/services/ns/svc?range=5m")
    body, shown = browser.panels_of(loaded.dom)
    assert body.get("data-loaded") == "1", loaded.dom[-2000:]
    assert loaded.console == []
    expected = (
        len(panels.SERVICE.panels) + len(panels.AUTOSCALING.panels) + len(panels.ROLLOUTS.panels)
    )
    assert len(shown) == expected
    states = {(p["data-section"], p["data-title"]): p["data-state"] for p in shown}
    assert not {"error", "loading"} & set(states.values()), states
    for title in ("Replicas: desired, provisioned, ready", "Replicas each policy asked for",
                  "Demand and forecast (replicas at target)", "Why: the last decision"):  # fmt: skip
        assert states[("autoscaling:edge", title)] == "ok", title
    # no gateway is scraped here: its panels say so rather than fail
    assert states[("service", "Requests per second by tier")] == "empty"
    drawn = next(p for p in shown if p["data-title"] == "Replicas: desired, provisioned, ready")
    assert int(drawn["data-series"]) == 3
    assert int(drawn["data-points"]) >= 2
    assert '<path d="M' in loaded.dom
    assert 'class="series"' in loaded.dom


def test_hovering_a_chart_shows_each_series_value_at_that_time(served: dict[str, Any]) -> None:
    """Driven over the DevTools protocol: the mouse over the replicas chart's latest sample
    shows a rule and each series' value there; leaving hides them; nothing is logged."""
    desired = served["view"].scaling.desired["edge"]
    Kube.eventually(lambda: _panel(
        served, "autoscaling", "Replicas: desired, provisioned, ready", pool="edge", range="5m",
    ).json()["series"], what="Prometheus to hold the desired replicas")  # fmt: skip
    panel = (
        '[...document.querySelectorAll("section.panel")]'
        '.find((n) => n.dataset.title === "Replicas: desired, provisioned, ready")'
    )

    async def look() -> tuple[list[str], bool, list[str], list[str]]:
        async with browser.tab(served["url"] + "/services/ns/svc?range=5m") as tab:
            await tab.wait_for('document.body.dataset.loaded === "1"')
            box = await tab.evaluate(
                f"(() => {{ const p = {panel}; p.scrollIntoView(); "
                "const r = p.querySelector('svg').getBoundingClientRect(); "
                "return [r.right, r.top + r.height / 2]; })()"
            )
            await tab.move(box[0] - 10, box[1])
            shown = await tab.evaluate(
                f"(() => {{ const t = {panel}.querySelector('.tip'); "
                "return t.hidden ? [] : [...t.children].map((c) => c.textContent); })()"
            )
            await tab.move(1, 1)
            hidden = await tab.evaluate(f"{panel}.querySelector('.tip').hidden")
            return shown, hidden, tab.problems, tab.requests

    shown, hidden, problems, requests = asyncio.run(look())
    # everything the page fetched came from the operator's own address
    assert requests
    assert [u for u in requests if not u.startswith(served["url"] + "/")] == []
    assert re.fullmatch(r"\d\d:\d\d:\d\d", shown[0]), shown
    assert f"desired: {desired}" in shown[1:], shown
    assert {"provisioned: 1", "ready: 1"} <= set(shown[1:]), shown
    assert hidden is True
    assert problems == []


def test_a_service_on_devices_shows_its_fleet_and_queries_by_the_fleets_name(
    served: dict[str, Any],
) -> None:
    """examples/edge-fleet.yaml's edge tier runs on the kiosks fleet: its page gets the
    fleet section, whose queries select that fleet."""
    view = _edge_fleet_view()
    assert [(s.key, s.values) for s in page.sections(view)][-1] == ("fleet", {"fleet": "kiosks"})
    exported = control_metrics.OperatorMetrics(lambda: [view])
    port = free_ports(1)[0]
    stop = page.serve(exported, f"127.0.0.1:{port}", served["prometheus"])
    try:
        base = f"http://127.0.0.1:{port}/api/v1/services/shop/{view.name}/panels/fleet"
        r = httpx.get(f"{base}/0", timeout=30)
        html = httpx.get(f"http://127.0.0.1:{port}/services/shop/{view.name}", timeout=10).text
    finally:
        stop()
    assert r.status_code == 200, r.text
    assert r.json()["queries"] == ['sum by (phase) (hybridllm_fleet_devices{fleet="kiosks"})']
    assert '"title": "Edge fleet: kiosks"' in html


def _edge_fleet_view() -> control_metrics.ServiceView:
    doc = next(
        d for d in yaml.safe_load_all((ROOT / "examples" / "edge-fleet.yaml").read_text())
        if d["kind"] == "LLMService"
    )  # fmt: skip
    return control_metrics.ServiceView(
        "shop", doc["metadata"]["name"], crd.LLMServiceSpec.model_validate(doc["spec"])
    )


def test_the_fleet_section_in_a_real_browser_draws_the_fleet_servers_series(
    testenv: Any, served: dict[str, Any]
) -> None:
    """A fleet server's own metrics (its `Metrics`, as its leader exports them for the
    kiosks fleet) scraped by the real Prometheus: the page of the service on that fleet
    draws every fleet panel in headless Chromium, with data and nothing logged."""
    fleet = fleet_metrics.Metrics()
    fleet.devices.labels("kiosks", "Ready").set(3)
    fleet.devices.labels("kiosks", "Offline").set(1)
    fleet.revision_devices.labels("kiosks", "v1").set(3)
    fleet.revision_tokens.labels("kiosks", "v1").set(42.0)
    fleet.revision_errors.labels("kiosks", "v1").set(0.02)
    fleet.revision_ttft.labels("kiosks", "v1").set(0.3)
    fleet.heartbeat_age.labels("kiosks", "0.5").set(4.0)
    fleet.heartbeat_age.labels("kiosks", "1").set(9.0)
    fleet.site_stranded.labels("kiosks", "store-7").set(1200.0)
    fleet.requests.labels("heartbeat", "200").inc(10)
    fleet_port, page_port = free_ports(2)
    server, thread = start_http_server(fleet_port, "127.0.0.1", registry=fleet.registry)
    view = _edge_fleet_view()
    stop = page.serve(control_metrics.OperatorMetrics(lambda: [view]),
                      f"127.0.0.1:{page_port}", served["prometheus"], rate_floor_s=4)  # fmt: skip
    base = f"http://127.0.0.1:{page_port}"
    try:
        testenv.prometheus_targets(
            served["state"], [*served["targets"], (f"127.0.0.1:{fleet_port}", {})]
        )
        calls = page.DASHBOARDS["fleet"].panels.index(
            next(p for p in page.DASHBOARDS["fleet"].panels if p.title == "Device API calls")
        )

        def held() -> bool:
            answer = httpx.get(
                f"{base}/api/v1/services/shop/{view.name}/panels/fleet/{calls}",
                params={"range": "5m"}, timeout=30,
            ).json()  # fmt: skip
            series = answer["series"]
            return bool(series) and len(series[0]["points"]) >= 2

        Kube.eventually(held, what="Prometheus to hold two scrapes of the fleet server")
        loaded = browser.load(f"{base}/services/shop/{view.name}?range=5m")
    finally:
        stop()
        server.shutdown()
        thread.join(timeout=10)
        testenv.prometheus_targets(served["state"], served["targets"])
    body, shown = browser.panels_of(loaded.dom)
    assert body.get("data-loaded") == "1", loaded.dom[-2000:]
    assert loaded.console == []
    drawn = {p["data-title"]: p for p in shown if p["data-section"] == "fleet"}
    assert set(drawn) == {p.title for p in panels.FLEET.panels}
    assert {t: p["data-state"] for t, p in drawn.items()} == dict.fromkeys(drawn, "ok")
    assert int(drawn["Devices by state"]["data-series"]) == 2  # Ready and Offline
    assert int(drawn["Heartbeat age"]["data-series"]) == 2  # the median and the oldest
    assert int(drawn["Online devices by revision"]["data-points"]) >= 2
