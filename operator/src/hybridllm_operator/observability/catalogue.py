"""The metrics catalogue: every metric each component exports, read from the code.

Each component builds its metrics on a registry of its own; this module instantiates
them (nothing is served) and reads name, type, labels and help from the registered
collectors. ``hybridllm observability generate`` writes the result to docs/metrics.md, and
``--check`` (in ``make lint``) fails when the file is stale or a metric breaks the naming
rules (`problems`). The dashboards' and alerts' tests check every metric they query
against `catalogue()`.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from hybridllm_common import metrics as names

DOC = Path("docs/metrics.md")


@dataclass(frozen=True)
class Entry:
    """One exported metric family as scraped (counters with their ``_total``)."""

    name: str
    type: str  # counter, gauge, histogram, summary, info
    labels: tuple[str, ...]
    help: str
    component: str

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names a query can select."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.type == "summary":
            return (self.name, f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    @property
    def unit(self) -> str:
        for suffix, unit in (
            ("_seconds", "seconds"), ("_seconds_total", "seconds"), ("_bytes", "bytes"),
            ("_bytes_total", "bytes"), ("_tokens_total", "tokens"), ("_ratio", "ratio (0-1)"),
            ("_rate", "ratio (0-1)"), ("_replicas", "replicas"), ("_per_second", "per second"),
        ):  # fmt: skip
            if self.name.endswith(suffix):
                return unit
        return ""


def _component_registries() -> list[tuple[str, Callable[[], CollectorRegistry]]]:
    """(component, a function building its registry), imported lazily: the cloud
    runtime's module imports torch."""

    def attr(module: str, path: str) -> Callable[[], CollectorRegistry]:
        def build() -> CollectorRegistry:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
            built = obj()
            # metrics a component registers only when a feature is on are listed too
            for enable in ("enable_speculative",):
                if hasattr(built, enable):
                    getattr(built, enable)()
            return built.registry  # type: ignore[no-any-return]

        return build

    return [
        ("gateway", attr("hybridllm_gateway.metrics", "GatewayMetrics")),
        ("cloud runtime", attr("hybridllm_cloud.server.metrics", "ServerMetrics")),
        ("edge runtime", attr("hybridllm_edge.server.metrics", "ServerMetrics")),
        ("operator", attr("hybridllm_operator.observability.metrics", "OperatorMetrics")),
        ("fleet server", attr("hybridllm_operator.edgefleet.server", "Metrics")),
    ]


def _entries(component: str, registry: CollectorRegistry) -> list[Entry]:
    out: list[Entry] = []
    for family in registry.collect():
        labels = tuple(getattr(family, "_labelnames", ()))
        if not labels:  # a client-library metric: its labels are on the collector
            labels = _collector_labels(registry, family.name)
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append(Entry(name, family.type, labels, family.documentation, component))
    return out


def _collector_labels(registry: CollectorRegistry, name: str) -> tuple[str, ...]:
    for collector in registry._collector_to_names:  # no public accessor
        if getattr(collector, "_name", None) == name:
            return tuple(getattr(collector, "_labelnames", ()))
    return ()


def catalogue() -> list[Entry]:
    """Every component's metrics, sorted by component then name."""
    out: list[Entry] = []
    for component, build in _component_registries():
        out += sorted(_entries(component, build()), key=lambda e: e.name)
    return out


def series(entries: list[Entry]) -> dict[str, Entry]:
    """Sample name -> its family (the first component that exports it)."""
    out: dict[str, Entry] = {}
    for entry in entries:
        for s in entry.series:
            out.setdefault(s, entry)
    return out


def problems(entries: list[Entry]) -> list[str]:
    """Breaks of the naming rules (Prometheus's conventions), one line each."""
    out: list[str] = []
    types: dict[str, Entry] = {}
    for e in entries:
        where = f"{e.component}: {e.name}"
        if not e.name.startswith(names.PREFIX):
            out.append(f"{where}: does not start with {names.PREFIX!r}")
        if e.type == "counter" and not e.name.endswith("_total"):
            out.append(f"{where}: a counter's name ends with _total")
        if e.type != "counter" and e.name.endswith("_total"):
            out.append(f"{where}: a {e.type} named like a counter (_total)")
        if any(w in e.name for w in ("_milliseconds", "_ms_", "_minutes", "_hours")):
            out.append(f"{where}: not in base units (seconds)")
        if not e.help.strip():
            out.append(f"{where}: no help text")
        first = types.setdefault(e.name, e)
        if first.type != e.type:
            out.append(f"{where}: a {e.type} here, a {first.type} in the {first.component}")
    return out


def render(entries: list[Entry]) -> str:
    lines = [
        "# Metrics",
        "",
        "<!-- Generated by `hybridllm observability generate` from the components' "
        "registries; `make lint` fails when it is stale. -->",
        "",
        "Every metric hybridllm exports, by component. In a cluster, the chart's PodMonitor "
        "adds `namespace`, `llmservice`, `component` and `revision` to the gateways' and "
        "runtimes' series; the operator's carry `namespace` and `llmservice` themselves "
        "(scraped with `honorLabels`). The dashboards (docs/dashboards.md) and alerts query "
        "only these names; a test checks it.",
        "",
    ]
    for component, group in itertools.groupby(entries, key=lambda e: e.component):
        lines += [
            f"## {component}",
            "",
            "| Metric | Type | Labels | Unit | Meaning |",
            "|---|---|---|---|---|",
        ]
        for e in group:
            labels = ", ".join(f"`{label}`" for label in e.labels) or "-"
            text = " ".join(e.help.split()).replace("|", "\\|")
            lines.append(f"| `{e.name}` | {e.type} | {labels} | {e.unit or '-'} | {text} |")
        lines.append("")
    return "\n".join(lines)
