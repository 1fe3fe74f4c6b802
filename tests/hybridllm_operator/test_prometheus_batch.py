"""Every LLMService's demand from shared queries: three gateways' metrics (the gateway's own
registry, served over HTTP) scraped by a real Prometheus with the labels the chart gives
them, read by the operator's `PrometheusDemand` with one `PrometheusBatch` and without:
the same demand, learned speed and history for each service, from seven queries for all
of them."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import start_http_server

from hybridllm_common import speed
from hybridllm_gateway.metrics import GatewayMetrics
from hybridllm_operator.llmservice import demand
from hybridllm_operator.local.plan import free_ports

SERVICES = (("ns1", "a"), ("ns1", "b"), ("ns2", "a"))  # one name in two namespaces
BIN_S = 2.0
SETTLED_S = 10.0


@pytest.fixture(scope="module")
def prometheus(testenv: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state = tmp_path_factory.mktemp("prometheus")
    servers = []
    targets = []
    for i, (namespace, name) in enumerate(SERVICES):
        metrics = GatewayMetrics()
        for tier in ("edge", "cloud"):
            metrics.offered.prompt.labels(tier).inc(1000 * (i + 1))
            metrics.offered.completion.labels(tier).inc(100 * (i + 1))
            metrics.outstanding.labels(tier).set(i + 1)
            metrics.held.labels(tier).set(0)
            metrics.cold.labels(tier).inc(0)
            metrics.ttft.labels(tier).observe(0.1 * (i + 1))
        for k in range(16):  # the edge replica's answers: 1,000 prompt tokens/s, a decode
            load = 1 + 7 * (k % 2)  # step of 10 ms + 2 ms per other answer in flight
            metrics.speeds.answered("edge", "http://edge-0:8000", speed.Answer(
                load, 100 * (k + 1), 0.02 + 0.1 * (k + 1), 11, 10 * (0.010 + 0.002 * (load - 1)),
            ))  # fmt: skip
        port = free_ports(1)[0]
        server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
        servers.append((server, metrics))
        targets.append((f"127.0.0.1:{port}", {"namespace": namespace, "llmservice": name}))
    stop = threading.Event()

    def traffic() -> None:  # each service answers tokens at its own rate
        while not stop.wait(0.1):
            for i, (_, metrics) in enumerate(servers):
                metrics.offered.prompt.labels("edge").inc(10 * (i + 1))
                metrics.offered.completion.labels("cloud").inc(i + 1)
                # saturation: the edge answers 503s, the cloud's attempts time out
                metrics.requests.labels(tier="edge", code="503").inc(i + 1)
                metrics.requests.labels(tier="edge", code="200").inc(5)
                metrics.upstream_errors.labels(tier="cloud", kind="timeout").inc(i + 1)
                metrics.upstream_errors.labels(tier="cloud", kind="connect").inc(5)

    threading.Thread(target=traffic, daemon=True).start()
    url = testenv.prometheus_up(state)
    testenv.prometheus_targets(state, targets)
    try:
        # The tests read settled data (SETTLED_S old: every scrape of it is in, and up to a
        # quantum or two bins older): wait until each service reads without problems that far
        # back (a rate needs two samples).
        deadline = time.monotonic() + 90
        for namespace, name in SERVICES:
            own = demand.PrometheusDemand(url, namespace, name, bin_s=BIN_S, rate_window_s=10)
            while (problems := own.read(time.time() - SETTLED_S - 6).problems) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.5)
            assert not problems, f"Prometheus has not scraped {namespace}/{name}: {problems}"
        yield url
    finally:
        stop.set()
        for server, _ in servers:
            server.shutdown()
        testenv.stop(state, "prometheus")


def test_each_service_reads_from_the_batch_what_it_reads_alone(prometheus: str) -> None:
    batch = demand.PrometheusBatch(prometheus)
    at = math.floor((time.time() - SETTLED_S) / demand.EVAL_QUANTUM_S) * demand.EVAL_QUANTUM_S
    rates, timeouts = [], []
    for namespace, name in SERVICES:
        own = demand.PrometheusDemand(prometheus, namespace, name, bin_s=BIN_S, rate_window_s=10)
        shared = demand.PrometheusDemand(
            prometheus, namespace, name, bin_s=BIN_S, rate_window_s=10, batch=batch
        )
        alone, batched = own.read(at), shared.read(at)  # at: a multiple of the quantum
        assert not alone.problems
        assert batched == alone
        assert batched.tiers["edge"].in_flight == SERVICES.index((namespace, name)) + 1
        assert batched.tiers["cloud"].completion_tok_s > 0
        # the replicas' learned speed, for a pool whose capacity is left out
        learned = batched.tiers["edge"].speed
        assert learned is not None
        assert learned.answers == 16
        assert learned.step_s() == pytest.approx((0.008, 0.002), rel=0.02)
        assert batched.tiers["cloud"].speed is None  # no cloud answers measured
        rates.append(batched.tiers["edge"].prompt_tok_s)
        assert batched.tiers["edge"].overloaded > 0
        assert (batched.tiers["cloud"].overloaded, batched.tiers["edge"].timed_out) == (0, 0)
        timeouts.append(batched.tiers["cloud"].timed_out)
    # each service its own rate (service i answers i + 1 times the first's), not another's
    assert 0 < rates[0] < rates[1] < rates[2]
    assert 0 < timeouts[0] < timeouts[1] < timeouts[2]
    # seven instant queries (prompt, completion, in flight, waiting, TTFT, the 503s and
    # timeouts, the replicas' speed) answered all three services
    assert batch.queries == 7


def test_the_newest_bin_from_the_batch_extends_the_history_as_a_whole_query_would(
    prometheus: str,
) -> None:
    batch = demand.PrometheusBatch(prometheus)
    end = math.floor((time.time() - SETTLED_S) / BIN_S) * BIN_S - BIN_S
    readers = {
        key: demand.PrometheusDemand(prometheus, *key, bin_s=BIN_S, rate_window_s=10, batch=batch)
        for key in SERVICES
    }
    for reader in readers.values():
        reader.read(end)  # the whole history, asked for each alone
    before = batch.queries
    for key, reader in readers.items():
        extended = reader.read(end + BIN_S).bins
        whole = demand.PrometheusDemand(prometheus, *key, bin_s=BIN_S, rate_window_s=10)
        assert extended == whole.read(end + BIN_S).bins
        assert extended["edge"][-1][0] > 0  # the new bin holds this service's tokens
        assert reader._bins_until == end + BIN_S
    # one new bin for all three: two queries (prompt, completion), beside the seven instant
    # ones when the new time is past the last one's evaluation quantum
    quantum = math.floor((end + BIN_S) / demand.EVAL_QUANTUM_S) != math.floor(
        end / demand.EVAL_QUANTUM_S
    )
    assert batch.queries - before == 2 + 7 * quantum


def test_a_prometheus_that_is_down_is_asked_once_for_every_service() -> None:
    batch = demand.PrometheusBatch(f"http://127.0.0.1:{free_ports(1)[0]}")
    snapshots = [
        demand.PrometheusDemand(batch.url, ns, name, batch=batch).read(time.time())
        for ns, name in SERVICES
    ]
    for snapshot in snapshots:
        assert set(snapshot.problems) == {"edge", "cloud"}
        assert "did not answer" in snapshot.problems["edge"]
    assert batch.queries == 1
