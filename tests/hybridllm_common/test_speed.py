"""The replica speed estimator on answers drawn from a known replica: it finds the replica's
figures, follows a replica that slows down, and is not thrown by stalled answers."""

from __future__ import annotations

import random

import pytest

from hybridllm_common.speed import MIN_OBSERVATIONS, Answer, ReplicaSpeed, Rls, SpeedTable


def _answers(rng: random.Random, n: int, *, overhead: float = 0.04, per_1k: float = 0.5,
             wait: float = 0.15, decode: float = 0.02, slowdown: float = 0.004,
             noise: float = 0.1, stalls: float = 0.0, held_per_1k: float = 0.0,
             prompts: tuple[int, int] = (50, 4000)) -> list[Answer]:  # fmt: skip
    """``n`` answers of a replica with these figures, each time off by up to ``noise``
    (multiplicative), a share ``stalls`` of them stalled 20x; with ``held_per_1k``, the
    prompts sent to it while an answer decodes (more at a higher load) hold its decoding
    that many seconds per 1000 tokens (an engine that prefills prompts whole)."""
    out = []
    for _ in range(n):
        load, prompt, tokens = rng.randint(1, 8), rng.randint(*prompts), rng.randint(2, 200)
        ttft = overhead + prompt / 1000 * per_1k + wait * (load - 1)
        tpot = decode + slowdown * (load - 1)
        ttft *= rng.uniform(1 - noise, 1 + noise)
        decode_s = tpot * (tokens - 1) * rng.uniform(1 - noise, 1 + noise)
        stalled = int(rng.uniform(0, 20) * (load - 1) * (tokens - 1)) if held_per_1k else 0
        decode_s += stalled / 1000 * held_per_1k
        if rng.random() < stalls:
            ttft *= 20
        out.append(Answer(load, prompt, ttft, tokens, decode_s, stalled))
    return out


def _close(got: float | None, want: float, rel: float) -> bool:
    return got is not None and abs(got - want) <= rel * want


def test_it_finds_a_replicas_figures_and_its_capacity() -> None:
    speed = ReplicaSpeed()
    for answer in _answers(random.Random(1), 400):
        speed.observe(answer)
    assert speed.ready()
    assert speed.observations == 400
    assert _close(speed.prefill_tokens_per_s, 2000.0, 0.05)  # 0.5 s per 1000 tokens
    assert _close(speed.wait_s_per_request, 0.15, 0.1)
    assert _close(speed.overhead_s, 0.04, 0.5)  # small beside the noise of the rest
    assert _close(speed.predict_tpot(1), 0.02, 0.05)
    assert _close(speed.predict_tpot(8), 0.02 + 7 * 0.004, 0.05)
    # 8 answers at once decode 8 / 48 ms = 167 tokens/s: the pool's capacity at 8 slots
    assert _close(speed.decode_tokens_per_s(8), 8 / 0.048, 0.05)
    want = 0.04 + 2.0 * 0.5 + 3 * 0.15 + 99 * (0.02 + 3 * 0.004)
    assert _close(speed.predict_seconds(2000, 100, load=4), want, 0.05)


def test_prefills_that_hold_the_decoding_are_told_apart_from_the_decode_step() -> None:
    """An engine that prefills whole prompts holds every stream meanwhile: an answer that
    shared its replica with more prompt tokens decodes slower. The stall term takes that
    share, so the decode step (what the capacity model needs: it counts the prefills in
    their own term) is the replica's own; a model without it reads the step 1.3x slower
    at a batch of 8 (the pool's capacity 0.77x)."""
    answers = _answers(random.Random(7), 800, held_per_1k=0.2)
    speed = ReplicaSpeed()
    for answer in answers:
        speed.observe(answer)
    assert _close(speed.predict_tpot(1), 0.02, 0.05)
    assert _close(speed.predict_tpot(8), 0.048, 0.05)
    assert _close(speed.tpot.theta[2], 0.2, 0.1)  # seconds held per 1000 prompt tokens
    assert _close(speed.decode_tokens_per_s(8), 8 / 0.048, 0.05)
    blind = Rls(2)  # the same answers, the stall left in the step
    for a in answers:
        blind.update([1.0, a.load - 1.0], a.decode_s / (a.output_tokens - 1))
    assert blind.predict([1.0, 7.0]) > 1.2 * 0.048


def test_it_follows_a_replica_that_slows_down() -> None:
    rng = random.Random(2)
    speed = ReplicaSpeed()
    for answer in _answers(rng, 300):
        speed.observe(answer)
    for answer in _answers(rng, 300, per_1k=1.0, decode=0.05):  # a noisy neighbour arrives
        speed.observe(answer)
    assert _close(speed.prefill_tokens_per_s, 1000.0, 0.1)
    assert _close(speed.predict_tpot(1), 0.05, 0.1)


def test_stalled_answers_move_it_little_and_impossible_ones_not_at_all() -> None:
    speed = ReplicaSpeed()
    for answer in _answers(random.Random(3), 600, stalls=0.05):
        speed.observe(answer)
    assert _close(speed.prefill_tokens_per_s, 2000.0, 0.2)
    assert _close(speed.predict_tpot(1), 0.02, 0.1)
    before = (list(speed.ttft.theta), speed.observations)
    for bad in (Answer(0, 10, 0.1, 5, 0.1), Answer(1, 10, float("nan"), 5, 0.1),
                Answer(1, 10, -1.0, 5, 0.1), Answer(1, 10, 0.1, 5, float("inf"))):  # fmt: skip
        speed.observe(bad)
    assert (speed.ttft.theta, speed.observations) == before


def test_a_new_replica_borrows_its_tiers_figures_until_it_has_its_own() -> None:
    table = SpeedTable()
    rng = random.Random(4)
    for answer in _answers(rng, 50):
        table.observe("cloud", "http://a", answer)
    assert table.of("cloud", "http://b") is table.tiers["cloud"]  # b never answered
    assert table.of("edge", "http://e") is None  # nothing known of the tier
    for answer in _answers(rng, MIN_OBSERVATIONS, decode=0.08):
        table.observe("cloud", "http://b", answer)
    own = table.of("cloud", "http://b")
    assert own is table.replicas[("cloud", "http://b")]
    assert table.keep({("cloud", "http://a")}) == [("cloud", "http://b")]
    assert ("cloud", "http://b") not in table.replicas


def test_a_wrong_observation_shape_is_refused() -> None:
    speed = ReplicaSpeed()
    with pytest.raises(ValueError, match="one per dimension"):
        speed.ttft.update([1.0, 2.0], 1.0)


def test_a_prefill_rate_the_prompts_cannot_measure_is_not_given() -> None:
    """Under load the time to first token carries the queue's noise: prompts of 50 to 150
    tokens leave the slope to it (the replay on engine replicas learned "rates" of 3 to 532
    tokens/s for 1,000), so no rate is given, where prompts of 50 to 4,000 measure it."""
    narrow, wide = ReplicaSpeed(), ReplicaSpeed()
    for answer in _answers(random.Random(3), 400, per_1k=1.0, noise=0.4, prompts=(50, 150)):
        narrow.observe(answer)
    for answer in _answers(random.Random(3), 400, per_1k=1.0, noise=0.4):
        wide.observe(answer)
    assert narrow.ready()
    assert narrow.prefill_tokens_per_s is None
    assert narrow.ttft.std_error(1) > 0.25 * narrow.ttft.theta[1]
    assert _close(wide.prefill_tokens_per_s, 1000.0, 0.15)
    # the router's prediction does not need the rate: the fitted line still predicts
    assert _close(narrow.predict_ttft(100, load=1), 0.04 + 0.1, 0.5)
