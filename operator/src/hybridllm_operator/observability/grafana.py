"""Grafana dashboards from `panels`, built with grafana-foundation-sdk (Grafana 11.6
types), written as JSON into the Helm chart (charts/hybridllm/files/dashboards/), which
ships them as ConfigMaps for Grafana's dashboard sidecar.

Every dashboard takes its Prometheus data source from a ``datasource`` variable, so an
import picks the data source instead of needing one named a certain way.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import table as gt
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

from hybridllm_common import metrics as n
from hybridllm_operator.observability import panels

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
HEIGHT = 8
# What each variable lists its values from (a metric every such target exports).
VARIABLE_SOURCES = {
    "namespace": f"label_values({n.GATEWAY_REQUESTS_TOTAL}, namespace)",
    "llmservice": f'label_values({n.GATEWAY_REQUESTS_TOTAL}{{namespace="$namespace"}}, llmservice)',
    "pool": f"label_values({n.AUTOSCALER_DESIRED_REPLICAS}"
    '{namespace="$namespace", llmservice="$llmservice"}, pool)',
    "fleet": f"label_values({n.FLEET_DEVICES}, fleet)",
}


def _target(q: panels.Query, ref: str, instant: bool) -> gp.Dataquery:
    target = gp.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(ref)
    target = target.datasource(DATASOURCE)
    return target.instant() if instant else target.range()


def _panel(p: panels.Panel, x: int, y: int) -> Any:
    builder: Any
    if p.kind == "stat":
        builder = gs.Panel()
    elif p.kind == "table":
        builder = gt.Panel().with_transformation(
            dm.DataTransformerConfig(id_val="merge", options={})
        )
    else:
        builder = gts.Panel().fill_opacity(5).line_width(1)
    builder = (
        builder.title(p.title)
        .description(p.description)
        .unit(p.unit)
        .datasource(DATASOURCE)
        .grid_pos(dm.GridPos(h=HEIGHT, w=p.width, x=x, y=y))
    )
    for i, q in enumerate(p.queries):
        builder = builder.with_target(_target(q, chr(ord("A") + i), instant=p.kind == "table"))
    if p.band is not None:
        lower, upper = p.band
        builder = builder.override_by_name(
            upper,
            [
                dm.DynamicConfigValue(id_val="custom.fillBelowTo", value=lower),
                dm.DynamicConfigValue(id_val="custom.fillOpacity", value=20),
                dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash"}),
            ],
        ).override_by_name(
            lower, [dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash"})]
        )
    return builder


def build(d: panels.Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model."""
    builder = (
        gd.Dashboard(d.title)
        .uid(d.uid)
        .description(d.description)
        .tags(["hybridllm", "generated"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for name in d.variables:
        builder = builder.with_variable(
            gd.QueryVariable(name)
            .label(name)
            .datasource(DATASOURCE)
            .query({"query": VARIABLE_SOURCES[name], "refId": name})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(False)
            .multi(False)
        )
    for a in d.annotations:
        builder = builder.annotation(
            gd.AnnotationQuery()
            .name("Scaling decisions")
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color("orange")
            .expr(a.expr)
        )
    x = y = 0
    for p in d.panels:
        if x + p.width > 24:
            x, y = 0, y + HEIGHT
        builder = builder.with_panel(_panel(p, x, y))
        x += p.width
    model: dict[str, Any] = json.loads(
        JSONEncoder(sort_keys=True, indent=2).encode(builder.build())
    )
    for annotation in model.get("annotations", {}).get("list", []):
        # Grafana's Prometheus annotations: the text from the legend-like template
        annotation.setdefault("titleFormat", "scaled")
        annotation.setdefault("textFormat", d.annotations[0].legend)
        annotation.setdefault("step", "15s")
    return model


def render(d: panels.Dashboard) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"
