"""Fixtures shared by every test folder: the real Kubernetes control plane (k8s marker) and GPU skips."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Resolve the one setting of the development traces for every test module: those
    modules read ``$HYBRIDLLM_TRACES`` (set here from bench/portable.py's default when
    unset) and mark what needs them ``dev_traces(...)``."""
    os.environ["HYBRIDLLM_TRACES"] = str(_load_bench("bench/portable.py").TRACES)
    if (getattr(config.option, "numprocesses", None) or 0) > 1 and not hasattr(
        config, "workerinput"
    ):
        # Workers as many as cores: each process (a worker, a server a test starts) gets
        # one OpenMP thread. With torch's default (a thread per core, spinning at each op's
        # barrier) two busy workers fought over the cores: the speculative-decoding tests
        # took 1,027 s beside the cluster tests against 188 s alone. Set before the workers
        # start, so they and their children inherit it.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# --- the suite's time budget -------------------------------------------------------------
# A whole-suite run (no paths, -k or -m given) on a warm machine must finish its tests in
# HYBRIDLLM_TEST_BUDGET_S. Past it the run fails, loudly, with the slowest tests. Warm: the
# model store held the converted models when the run started (a cold run converts them,
# and compiles llama.cpp for the clean-venv install test, inside the tests: it is
# reported, not failed). 40 min: the suite measures 28-33 min warm on two cores (README,
# "Development"), and CI's cold run has 90 min in all.
BUDGET_S = float(os.environ.get("HYBRIDLLM_TEST_BUDGET_S", "2400"))
_started = pytest.StashKey[tuple[float, bool]]()


def _whole_suite(config: pytest.Config) -> bool:
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
        and not getattr(config.option, "lf", False)
    )


def _warm() -> bool:
    from hybridllm_models import store

    root = store.default_root()
    return root.is_dir() and any(root.rglob("manifest.json"))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_started] = (time.monotonic(), _warm())


# --- every collected test reports --------------------------------------------------------
# With workers, the controller sees each worker's collection and each test's reports; a
# test collected and never reported (a worker gone quietly, a scheduler that stopped
# early) must fail the run, not leave it green with fewer tests: pytest would say only
# "N passed", N smaller than last time.
_collected: set[str] = set()
_reported: set[str] = set()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: called only with workers
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    _collected.update(ids)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        _reported.add(report.nodeid)


def _unreported() -> list[str]:
    return sorted(_collected - _reported)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _unreported() and not hasattr(config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _started not in config.stash or not _whole_suite(config) or hasattr(config, "workerinput"):
        return
    t0, warm = config.stash[_started]
    took = time.monotonic() - t0
    config.stash[_verdict] = (took, warm)
    if warm and took > BUDGET_S and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_verdict = pytest.StashKey[tuple[float, bool]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if missing := _unreported():
        terminalreporter.section("TESTS NEVER RUN", sep="!", red=True, bold=True)
        terminalreporter.write_line(
            f"{len(missing)} of the {len(_collected)} tests the workers collected never "
            "reported a result:", red=True, bold=True,
        )  # fmt: skip
        for nodeid in missing[:50]:
            terminalreporter.write_line(f"  {nodeid}", red=True)
    if _verdict not in config.stash:
        return
    took, warm = config.stash[_verdict]
    state = "warm" if warm else "cold: models converted during the run, not held to it"
    line = f"::phase tests budget: {took:.0f} s of {BUDGET_S:.0f} s ({state})"
    reports = [r for key in ("passed", "failed", "skipped", "error")
               for r in terminalreporter.stats.get(key, []) if hasattr(r, "duration")]  # fmt: skip
    # each worker's busy seconds (set-ups and teardowns too): the larger is the run's
    # critical path, the place to cut
    busy: dict[str, float] = {}
    for r in reports + [r for r in terminalreporter.stats.get("", []) if hasattr(r, "duration")]:
        worker = str(getattr(r, "worker_id", None) or "main")
        busy[worker] = busy.get(worker, 0.0) + r.duration
    terminalreporter.write_line("::phase tests busy: " + ", ".join(
        f"{w} {s:.0f} s" for w, s in sorted(busy.items())
    ))  # fmt: skip
    if not (warm and took > BUDGET_S):
        terminalreporter.write_line(line)
        return
    slowest = sorted(reports, key=lambda r: r.duration, reverse=True)[:15]
    terminalreporter.section("TEST BUDGET EXCEEDED", sep="!", red=True, bold=True)
    terminalreporter.write_line(
        f"{line}: the suite took {(took - BUDGET_S) / 60:.1f} min more than its budget. "
        "Make the slowest tests cheaper (share fixtures, merge walks of one path) before "
        "adding more; the slowest:", red=True, bold=True,
    )  # fmt: skip
    for r in slowest:
        terminalreporter.write_line(f"  {r.duration:8.1f} s  {r.when:8s} {r.nodeid}", red=True)


def dev_traces_missing(item: pytest.Item) -> list[Path]:
    """The files of the development traces that ``item``'s ``dev_traces`` marks name and
    this machine lacks (all of them when the folder itself is absent)."""
    root = Path(os.environ["HYBRIDLLM_TRACES"])
    wanted = [arg for mark in item.iter_markers("dev_traces") for arg in mark.args]
    return [root / rel for rel in wanted if not (root / rel).exists()]


def _load_testenv() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "hybridllm_testenv", ROOT / "hack" / "testenv" / "cluster.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hybridllm_testenv"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def testenv() -> ModuleType:
    """hack/testenv/cluster.py as a module (its Prometheus, helm and control-plane
    helpers), for tests that need one of its parts without the shared control plane."""
    return sys.modules.get("hybridllm_testenv") or _load_testenv()


def _load_bench(relpath: str) -> ModuleType:
    """A benchmark script (``bench/...py``) as a module, once per session."""
    name = "bench_" + relpath.removeprefix("bench/").removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bench_module() -> Any:
    """Load a benchmark script as a module: ``bench_module("bench/edge/servers.py")``,
    for the tests of a benchmark's harness."""
    return _load_bench


# --- two workers (pytest-xdist, `make test`: -n 2 --dist loadgroup) ------------------------
# A module is one unit of work (its module fixtures, a loaded model or a running local
# service, are built once), and every test that uses a Kubernetes control plane is one
# unit together: they share the session's control plane and in-process operator, the
# real node's host changes allow one at a time, and they mostly wait on the cluster, so
# the other worker runs the model-bound modules beside them.
CLUSTER_FIXTURES = frozenset({"k8s_cluster", "kube", "namespace", "operator"})


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _uses_cluster(item: pytest.Item) -> bool:
    uses = set(getattr(item, "fixturenames", ()))
    return bool(uses & CLUSTER_FIXTURES) or item.get_closest_marker("k8s") is not None


LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 60_000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran processes shows the end of each log they wrote in its
    ``tmp_path`` (the agents', the fleet server's, the operator's...): a failure in CI is
    read from that report alone, whose temporary folders are gone with the machine."""
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or not isinstance(tmp, Path):
        return
    left = LOG_TAIL_BYTES
    for log in sorted(tmp.glob("**/*.log"), key=lambda p: p.stat().st_mtime)[-20:]:
        with contextlib.suppress(OSError):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            text = "\n".join(lines)[-left:]
            left -= len(text)
            report.sections.append((f"log tail {log.relative_to(tmp)}", text))
        if left <= 0:
            break


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a module any of whose tests uses the cluster goes whole into the cluster unit: its
    # module fixtures (a real node) must never be set up on both workers at once
    cluster_modules = {_module(item) for item in items if _uses_cluster(item)}
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = "cluster" if _module(item) in cluster_modules else _module(item)
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "numprocesses", None):
        # the workers take units in this order (`--no-loadscope-reorder`: xdist would put
        # the units with most tests first), each the next when it runs dry: the cluster
        # unit (the longest) first, then the modules with slow tests, so that no long
        # module starts last while the other worker idles (a module stays in one piece)
        slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: (0 if _module(item) in cluster_modules else
                                     1 if _module(item) in slow_modules else 2))  # fmt: skip
    for item in items:
        if missing := dev_traces_missing(item):
            item.add_marker(pytest.mark.skip(
                reason=f"needs the development traces: {missing[0]} is absent "
                "(they are not in the repository; point HYBRIDLLM_TRACES at them)"
            ))  # fmt: skip
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), up once per run.

    Built from the Go module proxy on first use and cached under ~/.cache/hybridllm/testenv.
    Torn down by PID at the end of the session.
    """
    testenv = _load_testenv()
    state_dir = tmp_path_factory.mktemp("testenv")
    cluster = testenv.up(state_dir)
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    # The client library reads $KUBECONFIG once, when first imported, and test modules
    # import it at collection (through the operator's modules): point its default too,
    # for the in-process operator's kopf login and `load_kube_config()`.
    from kubernetes.config import kube_config

    previous_default = kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = previous_default
        testenv.down(state_dir)
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


@pytest.fixture(scope="session")
def broken_int8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the store's onnx-int8 artifact whose block scales were shuffled.

    The kind of damage hashes cannot see (a quantizer writing wrong scales, or kernels that
    compute something else on this CPU): the graph loads and runs, the manifest is the
    original's (its reference outputs included), and the answers are wrong on every CPU.
    """
    import shutil

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from hybridllm_models import convert, manifest, uri

    source = convert.ensure(uri.DEFAULT_URI, "onnx-int8")
    broken = tmp_path_factory.mktemp("broken") / "onnx-int8"
    shutil.copytree(source, broken)
    model = onnx.load(str(broken / "model.onnx"))
    rng = np.random.default_rng(0)
    scales = {i for n in model.graph.node if n.op_type == "MatMulNBits" for i in n.input[2:3]}
    for tensor in model.graph.initializer:
        if tensor.name in scales:
            values = numpy_helper.to_array(tensor).copy()
            rng.shuffle(values.reshape(-1))
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(broken / "model.onnx"))
    assert manifest.read(broken).reference is not None
    return broken


@pytest.fixture(scope="session")
def corrupt_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store whose ``source`` (the shipped GGUF) and ``hf`` artifacts are copies of
    the real ones with one byte flipped in the middle of their weights: same size, same
    manifest, so only a re-hash tells them apart. Point ``HYBRIDLLM_MODEL_CACHE`` at it."""
    import shutil

    from hybridllm_models import convert, store, uri

    real = store.Store()
    root = tmp_path_factory.mktemp("corrupt-store")
    for target in ("source", "hf"):
        artifact = convert.ensure_artifact(uri.DEFAULT_URI, target, model_store=real)
        copy = root / artifact.path.relative_to(real.root)
        shutil.copytree(artifact.path, copy)
        weights = copy / artifact.manifest.primary
        if weights.is_dir():
            weights = weights / "model.safetensors"
        with weights.open("r+b") as f:
            f.seek(weights.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    return root


@contextlib.contextmanager
def streams_beside(base_url: str, request: dict[str, Any], limit: int = 500) -> Iterator[list[str]]:
    """One client streams the same greedy completion again and again while the body of the
    ``with`` runs (a fuzzer, in the schema tests); at the end every stream must have
    completed, with the text the request gives when run alone. Yields the texts so far."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

    def stream() -> str:
        chunks = client.completions.create(**request, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    alone = stream()
    texts: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set() and len(texts) < limit:
            try:
                texts.append(stream())
            except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
                errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield texts
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors[:3]
    assert texts, "no stream completed beside the fuzzer"
    assert set(texts) == {alone}, (alone, sorted(set(texts) - {alone})[:3])
