"""The quality check's arithmetic and its record in the manifest, on small synthetic logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridllm_models import errors, manifest, quality, store
from hybridllm_models.store import Built

VOCAB = 300


def _logits(seed: int, prompts: list[list[int]]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 3, size=(len(p), VOCAB)).astype(np.float32) for p in prompts]


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_the_reference_itself_passes_with_zero_divergence() -> None:
    logits = _logits(0, PROMPTS)
    ref = quality.make_reference(PROMPTS, logits, "int8", computed_with="test")
    assert len(ref.positions[0]) == 5
    assert len(ref.positions[0][0].ids) == quality.TOP_K
    first = ref.positions[0][0]
    assert first.ids[0] == int(np.argmax(logits[0][0]))
    assert first.logprobs == sorted(first.logprobs, reverse=True)
    result = quality.compare(ref, logits)
    assert result.ok
    assert result.top1 == 1.0
    assert result.num_positions == 8
    assert result.mean_kl == pytest.approx(0.0, abs=1e-4)


def test_small_noise_passes_and_unrelated_logits_fail_with_both_numbers() -> None:
    logits = _logits(0, PROMPTS)
    ref = quality.make_reference(PROMPTS, logits, "int8", computed_with="test")
    rng = np.random.default_rng(1)
    noisy = [x + rng.normal(0, 0.05, size=x.shape).astype(np.float32) for x in logits]
    assert quality.compare(ref, noisy).ok
    unrelated = _logits(2, PROMPTS)
    result = quality.compare(ref, unrelated)
    assert not result.ok
    assert result.mean_kl > 1.0
    assert result.top1 < 0.5
    with pytest.raises(quality.QualityError) as caught:
        quality.check(ref, lambda ids: unrelated[0 if len(ids) == 5 else 1], "tiny/int8")
    message = str(caught.value)
    assert message.startswith("tiny/int8 failed its quality check: KL divergence")
    assert f"the limit of {quality.TOLERANCES['int8'].max_kl}" in message
    assert "top-1 agreement with the fp32 reference is" in message
    assert caught.value.result is not None
    assert not caught.value.result.ok


def test_a_uniform_shift_of_the_logits_changes_nothing() -> None:
    logits = _logits(3, PROMPTS)
    ref = quality.make_reference(PROMPTS, logits, "f32", computed_with="test")
    result = quality.compare(ref, [x + 7.0 for x in logits])
    assert result.ok
    assert result.mean_kl == pytest.approx(0.0, abs=1e-4)


def test_wrong_number_of_positions_is_an_error() -> None:
    ref = quality.make_reference(PROMPTS, _logits(0, PROMPTS), "f32", computed_with="test")
    with pytest.raises(ValueError, match="expected logits for 5 positions, got 4"):
        quality.compare(ref, [np.zeros((4, VOCAB)), np.zeros((3, VOCAB))])


def test_unknown_weight_type_has_no_tolerance() -> None:
    with pytest.raises(errors.ConversionError, match="no quality tolerance for weights of type"):
        quality.tolerance_for("Q2_K")


def test_reference_and_recipe_are_kept_in_the_manifest_and_an_old_recipe_is_rebuilt(
    tmp_path: Path,
) -> None:
    ref = quality.make_reference(PROMPTS, _logits(0, PROMPTS), "int8", computed_with="test")
    model_store = store.Store(tmp_path)
    builds = []

    def build(staging: Path) -> Built:
        builds.append(staging)
        (staging / "w.bin").write_bytes(b"x" * 10)
        return Built("onnx", "int8", 1, ".", reference=ref)

    def ensure(recipe: str) -> store.Artifact:
        return model_store.build_artifact(
            "m", "r", "onnx-int8", build, source_uri="file:///m", recipe=recipe
        )

    first = ensure("onnx-int8/1")
    reread = manifest.read(first.path)
    assert reread.recipe == "onnx-int8/1"
    assert reread.reference == ref
    assert ensure("onnx-int8/1").manifest.created_at == first.manifest.created_at
    assert len(builds) == 1
    assert ensure("onnx-int8/2").manifest.recipe == "onnx-int8/2"
    assert len(builds) == 2
