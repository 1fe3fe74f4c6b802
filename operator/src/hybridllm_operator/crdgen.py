"""Generate the CustomResourceDefinitions from the pydantic models in ``hybridllm_common.crd``.

Pydantic's JSON Schema is close to, but not, a Kubernetes *structural* schema. The
conversion here inlines every ``$ref``, collapses ``Optional[X]`` (``anyOf: [X, null]``)
to ``X`` (an absent field is the null), drops ``title`` and ``additionalProperties:
false`` (structural schemas allow neither beside ``properties``) and keeps what the API
server understands: types, descriptions, enums, bounds, patterns, defaults and the
``x-kubernetes-*`` extensions the models carry. The output is deterministic, so CI can
regenerate and diff (``hybridllm crds generate --check``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from hybridllm_common import crd

_KEEP = {
    "type",
    "description",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "items",
    "properties",
    "required",
    "additionalProperties",
    "nullable",
}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Return a structural copy of one JSON-Schema node."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        # The field's own description and default win over the referenced model's.
        target.update({k: v for k, v in node.items() if k in ("description", "default")})
        node = target
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(
                f"cannot express anyOf with {len(options)} non-null options structurally"
            )
        merged = dict(options[0])
        merged.update({k: v for k, v in node.items() if k != "default" or v is not None})
        node = _resolve(merged, defs)
        return node
    if node.get("default", ...) is None:
        node.pop("default")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key not in _KEEP:
            continue
        elif key == "properties":
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        elif key in ("items",):
            out[key] = _resolve(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _resolve(value, defs)
        else:
            out[key] = value
    # JSON Schema 2020 numbers -> OpenAPI 3.0 booleans beside minimum/maximum.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), int | float) and not isinstance(out.get(flag), bool):
            out[bound] = out[flag]
            out[flag] = True
    if out.get("type") == "number":
        _guard_fractional_bounds(out)
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = "integer" if kinds == {int} else "string"
    if "properties" in out:
        out["type"] = "object"
    return out


def _guard_fractional_bounds(node: dict[str, Any]) -> None:
    """Repeat fractional bounds of a number as CEL rules.

    The API server compares an integer value (``0``) with ``int64(minimum)``, so
    ``minimum: 0.05`` lets ``0`` through; CEL compares as doubles and catches it.
    """
    rules = []
    for bound, op, word in (("minimum", ">", "greater"), ("maximum", "<", "less")):
        value = node.get(bound)
        if isinstance(value, float) and not value.is_integer():
            strict = node.get(f"exclusive{bound[:1].upper()}{bound[1:]}") is True
            rules.append(
                {
                    "rule": f"self {op}{'' if strict else '='} {value!r}",
                    "message": f"must be {word} than {'' if strict else 'or equal to '}{value!r}",
                }
            )
    if rules:
        node["x-kubernetes-validations"] = [*node.get("x-kubernetes-validations", []), *rules]


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return dict(_resolve(raw, defs))


_COMMON_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether every pool has its desired replicas ready.",
    },
    {
        "name": "Reason",
        "type": "string",
        "priority": 1,
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Why the resource is or is not ready.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_KINDS: list[dict[str, Any]] = [
    {
        "kind": "LLMService",
        "plural": "llmservices",
        "singular": "llmservice",
        "short_names": ["llms"],
        "spec": crd.LLMServiceSpec,
        "status": crd.LLMServiceStatus,
        "root_rules": [
            crd.cel(
                f"size(self.metadata.name) <= {crd.MAX_SERVICE_NAME_LENGTH}",
                f"metadata.name must be at most {crd.MAX_SERVICE_NAME_LENGTH} characters "
                "(it prefixes the names of the Services the operator creates)",
            )
        ],
        "columns": [
            {
                "name": "Mode",
                "type": "string",
                "jsonPath": ".spec.cloud.mode",
                "description": "Cloud tier mode.",
            },
            {
                "name": "Edge",
                "type": "string",
                "jsonPath": ".status.edgeReplicas",
                "description": "Edge ready/desired.",
            },
            {
                "name": "Cloud",
                "type": "string",
                "jsonPath": ".status.cloudReplicas",
                "description": "Cloud ready/desired.",
            },
            {
                "name": "Revision",
                "type": "string",
                "jsonPath": ".status.currentRevision",
                "description": "Model revision serving traffic.",
            },
            {
                "name": "Scaling",
                "type": "string",
                "jsonPath": ".status.autoscaling",
                "description": "Autoscaler mode and last action.",
            },
            {
                "name": "Rollout",
                "type": "string",
                "jsonPath": ".status.rolloutSummary",
                "description": "Rollout phase, step and canary weight.",
            },
            *_COMMON_COLUMNS,
        ],
    },
    {
        "kind": "EdgeFleet",
        "plural": "edgefleets",
        "singular": "edgefleet",
        "short_names": ["efleet"],
        "spec": crd.EdgeFleetSpec,
        "status": crd.EdgeFleetStatus,
        "root_rules": [],
        "columns": [
            {
                "name": "Service",
                "type": "string",
                "jsonPath": ".spec.service",
                "description": "LLMService served.",
            },
            {
                "name": "Devices",
                "type": "integer",
                "jsonPath": ".status.devices",
                "description": "Devices reporting.",
            },
            {
                "name": "Ready-Devices",
                "type": "integer",
                "jsonPath": ".status.readyDevices",
                "description": "Devices serving the current revision.",
            },
            {
                "name": "Updated",
                "type": "integer",
                "jsonPath": ".status.updatedDevices",
                "description": "Devices on the current revision.",
            },
            {
                "name": "Offline",
                "type": "integer",
                "jsonPath": ".status.offlineDevices",
                "description": "Devices with no recent heartbeat.",
            },
            {
                "name": "Revision",
                "type": "string",
                "jsonPath": ".status.currentRevision",
                "description": "Revision the fleet should run.",
            },
            {
                "name": "Rollout",
                "type": "string",
                "jsonPath": ".status.rolloutSummary",
                "description": "Rollout phase and wave.",
            },
            *_COMMON_COLUMNS,
        ],
    },
    {
        "kind": "EdgeDevice",
        "plural": "edgedevices",
        "singular": "edgedevice",
        "short_names": ["edev"],
        "spec": crd.EdgeDeviceSpec,
        "status": crd.EdgeDeviceStatus,
        "root_rules": [],
        "columns": [
            {
                "name": "Fleet",
                "type": "string",
                "jsonPath": ".spec.fleet",
                "description": "EdgeFleet.",
            },
            {
                "name": "Approved",
                "type": "boolean",
                "jsonPath": ".spec.approved",
                "description": "May fetch configs and serve.",
            },
            {
                "name": "Phase",
                "type": "string",
                "jsonPath": ".status.phase",
                "description": "Pending, Approved, Ready, Updating, Offline or Revoked.",
            },
            {
                "name": "Revision",
                "type": "string",
                "jsonPath": ".status.revision",
                "description": "Revision it serves.",
            },
            {
                "name": "Endpoint",
                "type": "string",
                "jsonPath": ".status.endpoint",
                "description": "Where the gateway reaches it.",
                "priority": 1,
            },
            {
                "name": "Age",
                "type": "date",
                "jsonPath": ".metadata.creationTimestamp",
                "description": "Time since enrollment.",
            },
        ],
    },
]


def _mark_condition_lists(schema: dict[str, Any]) -> None:
    conditions = schema["properties"].get("conditions")
    if conditions is not None:
        conditions["x-kubernetes-list-type"] = "map"
        conditions["x-kubernetes-list-map-keys"] = ["type"]
        conditions["items"]["required"] = ["type", "status", "reason"]


def build_crd(kind: dict[str, Any]) -> dict[str, Any]:
    spec_schema = structural_schema(kind["spec"])
    status_schema = structural_schema(kind["status"])
    _mark_condition_lists(status_schema)
    root: dict[str, Any] = {
        "type": "object",
        "description": kind["spec"].__doc__.strip().splitlines()[0],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "hybridllm.io/v1alpha1"},
            "kind": {"type": "string", "description": kind["kind"]},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    if kind["root_rules"]:
        root["x-kubernetes-validations"] = kind["root_rules"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{kind['plural']}.{crd.GROUP}",
            "labels": {
                "app.kubernetes.io/name": "hybridllm",
                "app.kubernetes.io/part-of": "hybridllm",
            },
        },
        "spec": {
            "group": crd.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind["kind"],
                "listKind": f"{kind['kind']}List",
                "plural": kind["plural"],
                "singular": kind["singular"],
                "shortNames": kind["short_names"],
                "categories": ["hybridllm"],
            },
            "versions": [
                {
                    "name": crd.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": kind["columns"],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = "# Generated by `hybridllm crds generate` from hybridllm_common.crd. Do not edit.\n"


def render() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    return {
        f"{crd.GROUP}_{kind['plural']}.yaml": HEADER
        + yaml.safe_dump(build_crd(kind), sort_keys=False, width=100, allow_unicode=True)
        for kind in _KINDS
    }


def write(output_dir: Path) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = output_dir / name
        path.write_text(text)
        written.append(path)
    return written


def drift(output_dir: Path) -> list[str]:
    """Names of the files in ``output_dir`` that differ from what the models generate."""
    stale = []
    for name, text in render().items():
        path = output_dir / name
        if not path.exists() or path.read_text() != text:
            stale.append(name)
    return stale
