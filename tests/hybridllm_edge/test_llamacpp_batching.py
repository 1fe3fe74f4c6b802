"""The llama.cpp backend and the engine's slot choice, on the real SmolLM2 Q4_1 (no server).

``forward`` packs a step in slot order (llama.cpp splits a batch with a split KV at every
break in consecutive sequence ids) and must still return logits in the engine's order;
the engine hands out the lowest free slot so running slots stay consecutive.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hybridllm_edge import backends, config, engine, sampling
from hybridllm_edge.backends import Backend, SlotWork

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon"]


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    b = backends.load(config.EdgeSettings(parallel=4, max_model_len=64, threads=1,
                                          max_num_batched_tokens=64))  # fmt: skip
    yield b
    b.close()


def _release_all(backend: Backend) -> None:
    for slot in range(backend.info.num_slots):
        backend.release(slot)


def test_logits_come_back_in_work_order_whatever_the_slot_order(backend: Backend) -> None:
    prompts = [backend.encode(p, add_special=True) for p in PROMPTS]
    alone = []
    for slot, ids in zip([3, 0, 2], prompts, strict=True):
        _release_all(backend)
        alone.append(backend.forward([SlotWork(slot, ids, 0, True)])[0])
    _release_all(backend)
    # slots listed out of order, and one item in the middle that wants no logits
    work = [
        SlotWork(3, prompts[0], 0, True),
        SlotWork(1, prompts[1][:2], 0, False),
        SlotWork(0, prompts[1], 0, True),
        SlotWork(2, prompts[2], 0, True),
    ]
    rows = backend.forward(work)
    assert rows.shape == (3, backend.info.vocab_size)
    batch = backend._batch  # type: ignore[attr-defined]
    packed = [batch.seq_id[i][0] for i in range(batch.n_tokens)]
    assert packed == sorted(packed)  # one run of consecutive ids: one llama.cpp micro-batch
    for row, ref in zip(rows, alone, strict=True):
        assert int(np.argmax(row)) == int(np.argmax(ref))
        np.testing.assert_allclose(row, ref, atol=0.05)
    assert [backend.slot_length(s) for s in range(4)] == [
        len(prompts[1]), 2, len(prompts[2]), len(prompts[0])
    ]  # fmt: skip
    # the next decode step, again out of order, continues each slot's own sequence
    nxt = [int(np.argmax(r)) for r in rows]
    step = [
        SlotWork(2, [nxt[2]], len(prompts[2]), True),
        SlotWork(3, [nxt[0]], len(prompts[0]), True),
    ]
    out = backend.forward(step)
    _release_all(backend)
    ref3 = backend.forward([SlotWork(3, prompts[0] + [nxt[0]], 0, True)])[0]
    np.testing.assert_allclose(out[1], ref3, atol=0.05)
    _release_all(backend)


def test_a_step_over_the_batch_size_is_refused_before_it_is_written(backend: Backend) -> None:
    _release_all(backend)
    too_long = [SlotWork(0, [1] * 40, 0, False), SlotWork(1, [1] * 40, 0, True)]
    with pytest.raises(ValueError, match="exceeds n_batch"):
        backend.forward(too_long)
    ids = backend.encode(PROMPTS[0], add_special=True)
    assert backend.forward([SlotWork(0, ids, 0, True)]).shape == (1, backend.info.vocab_size)
    _release_all(backend)


def test_engine_hands_out_the_lowest_free_slot(backend: Backend) -> None:
    eng = engine.Engine(backend, max_num_batched_tokens=64)  # not started: driven by hand
    params = sampling.SamplingParams(max_tokens=4, temperature=0)
    reqs = [engine.EngineRequest(f"r{i}", [1, 2], params, lambda _: None) for i in range(6)]
    for r in reqs[:4]:
        eng.add(r)
    eng._drain(block=False)
    eng._admit()
    assert [r.slot for r in reqs[:4]] == [0, 1, 2, 3]
    eng._finish(reqs[2])
    eng._finish(reqs[0])
    eng.add(reqs[4])
    eng.add(reqs[5])
    eng._drain(block=False)
    eng._admit()
    assert (reqs[4].slot, reqs[5].slot) == (0, 2)
    for r in (reqs[1], reqs[3], reqs[4], reqs[5]):
        eng._finish(r)


def test_a_prefix_copied_from_another_slot_continues_as_if_computed_there(
    backend: Backend,
) -> None:
    """The prompt cache across slots: slot 1 gets slot 0's KV, cut to a prefix, and the
    rest of the prompt computed on it gives the logits of the whole prompt computed alone
    (an empty or stale copy would not)."""
    _release_all(backend)
    ids = backend.encode(
        "Once upon a time, in a kingdom by the sea, there lived a", add_special=True
    )
    other = backend.encode("A recipe for bread: flour, water, salt and", add_special=True)
    whole = backend.forward([SlotWork(0, ids, 0, True)])[0]
    backend.forward([SlotWork(1, other, 0, False)])  # slot 1 held something else
    keep = len(ids) - 4
    backend.copy(0, 1)
    assert backend.truncate(1, keep) == keep
    assert backend.slot_length(1) == keep
    assert backend.slot_length(0) == len(ids)  # the source is untouched
    rest = backend.forward([SlotWork(1, ids[keep:], keep, True)])[0]
    assert int(np.argmax(rest)) == int(np.argmax(whole))
    np.testing.assert_allclose(rest, whole, atol=0.05)
    _release_all(backend)
    fresh = backend.forward([SlotWork(1, ids[keep:], 0, True)])[0]  # no prefix: other logits
    assert np.abs(fresh - whole).max() > 1.0
    _release_all(backend)


def test_engine_takes_a_prompt_prefix_from_a_free_slot_or_copies_it_from_a_running_one(
    backend: Backend,
) -> None:
    _release_all(backend)
    eng = engine.Engine(backend, max_num_batched_tokens=64)  # not started: driven by hand
    params = sampling.SamplingParams(max_tokens=4, temperature=0)
    shared = list(range(100, 100 + engine.MIN_PREFIX_TOKENS + 4))

    def request(name: str, prompt: list[int]) -> engine.EngineRequest:
        req = engine.EngineRequest(name, prompt, params, lambda _: None)
        eng.add(req)
        eng._drain(block=False)
        eng._admit()
        return req

    a = request("a", [1, *shared, 7])
    assert (a.slot, a.num_cached) == (0, 0)
    eng._step()  # a's prompt is computed: a running slot now holds the shared prefix
    b = request("b", [1, *shared, 8, 9])
    assert (b.slot, b.num_cached) == (1, 1 + len(shared))  # copied from slot 0 into slot 1
    short = request("c", [1, *shared[:4], 5])  # a prefix too short to be worth a slot
    assert (short.slot, short.num_cached) == (2, 0)
    eng._finish(a)
    eng._finish(short)
    d = request("d", [1, *shared, 9])  # slot 0, free, holds it: taken as it is
    assert (d.slot, d.num_cached) == (0, 1 + len(shared))
    for r in (b, d):
        eng._finish(r, keep=False)
    assert [backend.slot_length(s) for s in range(3)] == [0, 0, eng.cached_length(2)]
    _release_all(backend)


def test_a_tenant_never_reuses_another_tenants_cached_prefix(backend: Backend) -> None:
    """The prompt cache is partitioned by cache_salt (the gateway sets it to the tenant):
    tenant B's request, sharing a long prefix with tenant A's, finds none of it cached,
    neither in A's running slot nor in A's free one (its usage would report how much of
    A's prompt it guessed right); a second request of A's reuses it."""
    _release_all(backend)
    eng = engine.Engine(backend, max_num_batched_tokens=64)  # not started: driven by hand
    params = sampling.SamplingParams(max_tokens=4, temperature=0)
    secret = list(range(200, 200 + engine.MIN_PREFIX_TOKENS + 8))

    def request(name: str, prompt: list[int], salt: str) -> engine.EngineRequest:
        req = engine.EngineRequest(name, prompt, params, lambda _: None, cache_salt=salt)
        eng.add(req)
        eng._drain(block=False)
        eng._admit()
        return req

    a = request("a", [1, *secret, 7], "tenant-a")
    eng._step()  # running, its prompt computed
    b = request("b", [1, *secret, 8], "tenant-b")
    assert b.num_cached == 0  # not copied from A's running slot
    eng._finish(a)  # A's slot is free and keeps A's prompt
    eng._finish(b, keep=False)
    b2 = request("b2", [1, *secret, 9], "tenant-b")
    assert b2.num_cached == 0
    eng._finish(b2, keep=False)
    a2 = request("a2", [1, *secret, 9], "tenant-a")
    assert a2.num_cached == 1 + len(secret)
    eng._finish(a2, keep=False)
    _release_all(backend)
