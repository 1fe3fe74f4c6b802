"""Shared pieces of the CRD models: the API group, CEL rules, the model base class."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "hybridllm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Longest LLMService name: children are named "<name>-<component>" and Service names
# are DNS-1035 labels of at most 63 characters ("-monolithic" is the longest suffix).
MAX_SERVICE_NAME_LENGTH = 42

_QUANTITY = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_MODEL_URI = r"^(pypi|file|hf|s3|gs|https?)://.+"
CIDR_PATTERN = r"^[0-9a-fA-F.:]+/[0-9]{1,3}$"  # parsed for real by ipaddress


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """One CEL validation rule as the API server expects it in ``x-kubernetes-validations``."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _sub(model: type[_Model], description: str) -> Any:
    """A nested object field that defaults to the model's own defaults, written out in full.

    The API server checks a default against the CEL rules beside it without applying the
    nested defaults first, so ``default: {}`` would fail ``self.minReplicas <= ...``.
    """
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": model().to_wire()},
    )
