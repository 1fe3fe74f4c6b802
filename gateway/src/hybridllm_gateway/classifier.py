"""Edge-or-cloud classifier: request features, a logistic model, and rules as the fallback.

Features are cheap to compute from the request body alone (no tokenizer in the gateway:
prompt tokens are estimated as characters / 4, the usual ratio for English BPE):
log prompt tokens, number of turns, tools present, log ``max_tokens``, counts of code
markers and of reasoning markers, and the share of the prompt in a system message.

The model is scikit-learn's ``LogisticRegression`` on standardised features, trained by
``hybridllm-gateway train-classifier`` on the labelled set shipped in ``data/`` (built by
``hack/labelset.py``). It is saved as JSON (means, scales, coefficients,
intercept, threshold), not as a pickle: loading it runs no code, and scoring is one dot
product in pure Python (about a microsecond), so scikit-learn is not on the hot path.
When no model file can be loaded the rules in :func:`rules` decide, and the reason
label says so.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MODEL = Path(__file__).parent / "data" / "classifier.json"
DEFAULT_LABELS = Path(__file__).parent / "data" / "routing_labels.jsonl"

FEATURES = (
    "log_prompt_tokens",
    "num_turns",
    "has_tools",
    "log_max_tokens",
    "code_markers",
    "reasoning_markers",
    "system_share",
)

CODE_RE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+|\bimport \w+|\bfunction\b|=>|\breturn\b|;\s*$|\bSELECT\b|"
    r"#include|\bpublic static\b|\bstack ?trace\b|\bTraceback\b|\bcompile|\bregex\b|\bSQL\b|"
    r"\bbug\b|\bdebug|\brefactor",
    re.IGNORECASE | re.MULTILINE,
)
REASONING_RE = re.compile(
    r"step[- ]by[- ]step|\bprove\b|\bproof\b|\bderive\b|\bwhy\b|\banaly[sz]e\b|\bcompare\b|"
    r"\btrade-?offs?\b|\bplan\b|\bcalculate\b|\bestimate\b|\bsolve\b|\bequation\b|\btheorem\b|"
    r"\bevaluate\b|\bjustify\b|\bpros and cons\b|\bdesign\b|\barchitecture\b|\bstrategy\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Features:
    prompt_chars: int
    num_turns: int
    has_tools: bool
    max_tokens: int | None
    code_markers: int
    reasoning_markers: int
    system_chars: int

    @property
    def prompt_tokens(self) -> int:
        return (self.prompt_chars + 3) // 4

    def vector(self) -> list[float]:
        return [
            math.log1p(self.prompt_tokens),
            float(self.num_turns),
            1.0 if self.has_tools else 0.0,
            math.log1p(self.max_tokens if self.max_tokens is not None else 256),
            math.log1p(self.code_markers),
            math.log1p(self.reasoning_markers),
            self.system_chars / max(self.prompt_chars, 1),
        ]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """The request's prompt as one string (chat messages joined, or the completion prompt)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return "\n".join(prompt)
    if isinstance(prompt, list):
        return "x" * (4 * len(prompt))  # token ids: keep the length, the text is unknown
    return ""


def extract(body: dict[str, Any]) -> Features:
    text = prompt_text(body)
    found = body.get("messages")
    messages: list[Any] = found if isinstance(found, list) else []
    system = sum(
        len(_text(m.get("content")))
        for m in messages
        if isinstance(m, dict) and m.get("role") in ("system", "developer")
    )
    turns = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user") or 1
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return Features(
        prompt_chars=len(text),
        num_turns=turns,
        has_tools=bool(body.get("tools") or body.get("functions")),
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        code_markers=len(CODE_RE.findall(text)),
        reasoning_markers=len(REASONING_RE.findall(text)),
        system_chars=system,
    )


def rules(f: Features) -> str:
    """The fallback: the cloud for anything long, tool-using, code or reasoning heavy."""
    if f.has_tools or f.code_markers >= 2 or f.reasoning_markers >= 2:
        return "cloud"
    if f.prompt_tokens > 1024 or f.num_turns > 6:
        return "cloud"
    if f.max_tokens is not None and f.max_tokens > 512:
        return "cloud"
    return "edge"


@dataclass(frozen=True)
class LinearModel:
    """Standardised logistic regression; P(cloud) = sigmoid(w . (x - mean) / scale + b)."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float
    threshold: float = 0.5

    def p_cloud(self, f: Features) -> float:
        z = self.intercept
        for x, m, s, w in zip(f.vector(), self.mean, self.scale, self.coef, strict=True):
            z += w * (x - m) / s
        return 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))

    def predict(self, f: Features) -> str:
        return "cloud" if self.p_cloud(f) >= self.threshold else "edge"

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(FEATURES),
            "mean": list(self.mean),
            "scale": list(self.scale),
            "coef": list(self.coef),
            "intercept": self.intercept,
            "threshold": self.threshold,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinearModel:
        if tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"model features {data.get('features')} are not {list(FEATURES)}")
        return cls(
            mean=tuple(data["mean"]),
            scale=tuple(data["scale"]),
            coef=tuple(data["coef"]),
            intercept=float(data["intercept"]),
            threshold=float(data.get("threshold", 0.5)),
        )


class Classifier:
    """The model when one loads, else the rules; ``decide`` returns (tier, reason)."""

    def __init__(self, model: LinearModel | None) -> None:
        self.model = model

    @classmethod
    def load(cls, path: Path | None) -> Classifier:
        path = path or DEFAULT_MODEL
        try:
            return cls(LinearModel.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("classifier model %s not usable (%s); routing by rules", path, exc)
            return cls(None)

    def decide(self, f: Features) -> tuple[str, str]:
        if self.model is None:
            return rules(f), "rules"
        return self.model.predict(f), "classifier"


def read_labels(path: Path) -> tuple[list[Features], list[int]]:
    xs, ys = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            xs.append(extract(row["request"]))
            ys.append(1 if row["label"] == "cloud" else 0)
    return xs, ys


def train(labels: Path, seed: int = 0) -> tuple[LinearModel, dict[str, float]]:
    """Fits the model on 80% of the set; returns it with held-out accuracy (model and rules)."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    feats, ys = read_labels(labels)
    x = np.array([f.vector() for f in feats])
    y = np.array(ys)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(x[idx_train])
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    lr = LogisticRegression(C=1.0, max_iter=1000).fit(
        (x[idx_train] - scaler.mean_) / scale, y[idx_train]
    )
    model = LinearModel(
        mean=tuple(float(v) for v in scaler.mean_),
        scale=tuple(float(v) for v in scale),
        coef=tuple(float(v) for v in lr.coef_[0]),
        intercept=float(lr.intercept_[0]),
    )
    test = [(feats[i], ys[i]) for i in idx_test]
    acc_model = sum((model.predict(f) == "cloud") == bool(t) for f, t in test) / len(test)
    acc_rules = sum((rules(f) == "cloud") == bool(t) for f, t in test) / len(test)
    return model, {
        "num_train": float(len(idx_train)),
        "num_test": float(len(test)),
        "accuracy": acc_model,
        "rules_accuracy": acc_rules,
    }
