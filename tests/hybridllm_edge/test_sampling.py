"""The edge sampler's penalties (numpy), against OpenAI's definition."""

from __future__ import annotations

import numpy as np
import pytest

from hybridllm_edge import sampling


def test_penalties_follow_openais_definition() -> None:
    logits = np.array([3.0, 2.9, 1.0, 0.0], dtype=np.float32)
    out = sampling.apply_penalties(logits, [0, 0, 2], presence=0.5, frequency=0.2)
    np.testing.assert_allclose(out, [3.0 - 0.9, 2.9, 1.0 - 0.7, 0.0], rtol=1e-6)
    assert logits[0] == pytest.approx(3.0)  # the caller's row is not modified
    params = sampling.SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=0.5)
    choice = sampling.sample(logits, params, None, [0, 0])
    assert choice.token_id == 1
    # the reported log-probability is the model's own, before the penalty
    raw = sampling.log_softmax(logits)
    assert choice.logprob == pytest.approx(float(raw[1]))
    assert sampling.sample(logits, params, None, []).token_id == 0
