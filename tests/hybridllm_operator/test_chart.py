"""The Helm chart (charts/hybridllm) with the pinned helm (hack/testenv/build-helm.sh):
lint, the helm-unittest suites, its output accepted by the real API server, the values
table current, and install / upgrade / rollback / uninstall against a real control plane
with the operator running as the chart's ServiceAccount and a `kubectl auth can-i` matrix
of what that account may and may not do."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridllm_operator import chartdocs

from .conftest import (
    CHART,
    OPERATOR_ACCOUNT,
    RELEASE,
    RELEASE_NAMESPACE,
    RESTRICTED,
    ROOT,
    Kube,
    helm,
    operator_account_env,
    own_control_plane,
    restricted_namespace,
)

OPERATOR_COMMAND = (sys.executable, "-m", "hybridllm_common.cli", "operator", "run")
APPS = "apps"  # the LLMServices' namespace in the install test
CRDS = ("llmservices.hybridllm.io", "edgefleets.hybridllm.io", "edgedevices.hybridllm.io")
# values that turn every optional part on (the monitors need prometheus-operator's CRDs,
# which this cluster lacks: they are checked by helm-unittest and lint, not the API server)
FLEET_ON = ("fleet.enabled=true", "fleet.tls.secretName=fleet-tls")


@pytest.fixture(scope="module")
def helm_ready(k8s_cluster: Any) -> None:
    """helm built (the session fixture loaded hack/testenv first)."""


@pytest.mark.usefixtures("helm_ready")
def test_lint_strict_and_the_unittest_suites_pass() -> None:
    for values in ((), FLEET_ON, (*FLEET_ON, "monitoring.serviceMonitor.enabled=true")):
        flags = [flag for value in values for flag in ("--set", value)]
        helm("lint", "--strict", str(CHART), *flags)
    out = helm("unittest", str(CHART)).stdout
    counts = re.search(r"Tests:\s+(\d+) passed, (\d+) total", out)
    assert counts is not None, out
    assert int(counts[1]) == int(counts[2]) >= 20, out


@pytest.mark.usefixtures("helm_ready")
def test_the_unittest_suites_fail_on_a_wrong_chart(tmp_path: Path) -> None:
    """The suites can fail: a chart whose operator may read Secrets is caught."""
    chart = tmp_path / "hybridllm"
    shutil.copytree(CHART, chart)
    rbac = chart / "templates" / "operator-rbac.yaml"
    rbac.write_text(rbac.read_text().replace("resources: [pods]", "resources: [pods, secrets]"))
    result = helm("unittest", str(chart), check=False)
    assert result.returncode != 0
    assert "operator RBAC" in result.stdout


def test_the_values_table_is_generated_from_values_yaml(tmp_path: Path) -> None:
    chart = tmp_path / "hybridllm"
    shutil.copytree(CHART, chart)
    assert chartdocs.update(chart, check=True), "run `hybridllm chart docs` and commit"
    values = chart / "values.yaml"
    values.write_text(values.read_text().replace("  replicaCount: 2\n", "  replicaCount: 3\n", 1))
    assert not chartdocs.update(chart, check=True)
    assert chartdocs.update(chart, check=False) is False  # rewritten
    assert "| `operator.replicaCount` | int | `3` |" in (chart / "README.md").read_text()
    values.write_text(values.read_text() + "extra: 1\n")
    with pytest.raises(chartdocs.DocsError, match=r"values without a `# --` comment.*extra"):
        chartdocs.update(chart, check=True)


@pytest.mark.parametrize(
    "values",
    [
        (),
        FLEET_ON,
        ("operator.watchNamespaces={team-a,team-b}", "crds.install=false"),
        ("operator.replicaCount=1", "operator.leaderElection.enabled=false"),
    ],
    ids=["defaults", "fleet", "namespaced", "single"],
)
def test_rendered_chart_is_accepted_by_the_api_server(kube: Kube, values: tuple[str, ...]) -> None:
    """Every object `helm template` makes passes the real API server's validation and
    admission (server-side dry run: nothing is stored), Pod Security "restricted" included:
    the namespaces enforce it, and a pod template that falls short is warned of."""
    for ns in (RELEASE_NAMESPACE, "team-a", "team-b"):
        if kube.run("get", "namespace", ns, check=False).returncode != 0:
            kube.run("create", "namespace", ns)
        kube.run("label", "--overwrite", "namespace", ns, RESTRICTED)
    flags = [flag for value in values for flag in ("--set", value)]
    rendered = helm("template", "dryrun", str(CHART), "-n", RELEASE_NAMESPACE, *flags).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(rendered) if d)
    assert "Deployment" in kinds
    result = kube.run("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert result.stdout.count("(server dry run)") == len(kinds), result.stdout
    assert "PodSecurity" not in result.stderr, result.stderr


# ---------------------------------------------------------------- install against a cluster


def _can_i(kube: Kube, account: str, *args: str) -> bool:
    result = kube.run("auth", "can-i", *args, f"--as={account}", check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


@pytest.fixture
def cluster(k8s_cluster: Any, tmp_path: Path) -> Iterator[tuple[Any, Kube]]:
    """A control plane of the test's own: the chart installs cluster-scoped objects (CRDs,
    ClusterRoles) that the session cluster holds already, unowned by any release."""
    with own_control_plane(tmp_path / "testenv", APPS, crds=False) as pair:
        yield pair


def test_install_serve_upgrade_a_crd_roll_back_and_uninstall_keeping_crds_and_services(
    cluster: tuple[Any, Kube], tmp_path: Path
) -> None:
    cl, kube = cluster
    kubeconfig = ("--kubeconfig", str(cl.kubeconfig))
    account = f"system:serviceaccount:{RELEASE_NAMESPACE}:{OPERATOR_ACCOUNT}"

    def crd(name: str) -> dict[str, Any] | None:
        result = kube.run("get", "crd", name, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def ready() -> bool:
        obj = kube.get("llmservice", "smollm2", APPS)
        conditions = ((obj or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # install: the README's command, into a namespace that enforces Pod Security
    # "restricted" (the operator's pods are admitted, then Ready below)
    restricted_namespace(kube, RELEASE_NAMESPACE)
    out = helm(
        "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
        "--wait", "--timeout=3m", *kubeconfig,
    ).stdout  # fmt: skip
    assert "STATUS: deployed" in out
    for name in CRDS:
        obj = crd(name)
        assert obj is not None
        assert obj["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    deployment = kube.get("deployment", f"{RELEASE}-operator", RELEASE_NAMESPACE)
    assert deployment is not None
    assert deployment["status"].get("readyReplicas") == 2  # kwok runs the pods

    # what the operator's account may and may not do
    may = [
        ("patch", "llmservices.hybridllm.io", "-n", APPS),
        ("patch", "llmservices.hybridllm.io/status", "-n", APPS),
        ("watch", "edgedevices.hybridllm.io", "-A"),
        ("watch", "edgefleets.hybridllm.io", "-A"),
        ("create", "deployments.apps", "-n", APPS),
        ("delete", "services", "-n", APPS),
        ("patch", "poddisruptionbudgets.policy", "-n", APPS),
        ("patch", "networkpolicies.networking.k8s.io", "-n", APPS),
        ("create", "secrets", "-n", APPS),  # the backend token, made once
        ("list", "pods", "-A"),
        ("create", "events", "-n", APPS),
        ("create", "leases.coordination.k8s.io", "-n", RELEASE_NAMESPACE),
        ("update", f"leases.coordination.k8s.io/{OPERATOR_ACCOUNT}", "-n", RELEASE_NAMESPACE),
    ]
    may_not = [
        ("get", "secrets", "-n", APPS),
        ("create", "pods", "-n", APPS),
        ("delete", "llmservices.hybridllm.io", "-n", APPS),
        ("create", "edgedevices.hybridllm.io", "-n", APPS),
        ("patch", "edgefleets.hybridllm.io/status", "-n", APPS),
        ("patch", "customresourcedefinitions.apiextensions.k8s.io"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", APPS),
        ("update", "leases.coordination.k8s.io/kube-scheduler", "-n", RELEASE_NAMESPACE),
        ("update", f"leases.coordination.k8s.io/{OPERATOR_ACCOUNT}", "-n", APPS),
        ("delete", "namespaces"),
        ("list", "nodes"),
    ]
    assert [a for a in may if not _can_i(kube, account, *a)] == []
    assert [a for a in may_not if _can_i(kube, account, *a)] == []

    # the operator as the chart's ServiceAccount (kwok runs the pods without a process:
    # the process runs here, with that account's token, as the leader)
    env = operator_account_env(cl, dict(os.environ), tmp_path)
    log = tmp_path / "operator.log"
    with log.open("ab") as sink:
        operator = subprocess.Popen(
            list(OPERATOR_COMMAND), env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        kube.run("apply", "-n", APPS, "-f", str(ROOT / "examples" / "edge-cloud-small.yaml"))
        kube.eventually(ready, timeout=120, what="the LLMService Ready")

        # upgrade with a changed CRD: the CRD is updated in place, the LLMService stays
        changed = tmp_path / "hybridllm"
        shutil.copytree(CHART, changed)
        path = changed / "files" / "crds" / "hybridllm.io_llmservices.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["versions"][0]["additionalPrinterColumns"].append(
            {"name": "Upgraded", "type": "string", "jsonPath": ".spec.model.revision"}
        )
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        chart_yaml = changed / "Chart.yaml"
        chart_yaml.write_text(chart_yaml.read_text().replace("version: 0.1.0", "version: 0.1.1"))
        helm("upgrade", RELEASE, str(changed), "-n", RELEASE_NAMESPACE, "--wait", *kubeconfig)

        def columns() -> list[str]:
            obj = crd("llmservices.hybridllm.io")
            assert obj is not None
            return [c["name"] for c in obj["spec"]["versions"][0]["additionalPrinterColumns"]]

        assert "Upgraded" in columns()
        assert "UPGRADED" in kube.run("get", "llms", "-n", APPS).stdout.splitlines()[0]
        assert ready()

        # rollback: the earlier CRD is back, the LLMService still there and Ready
        helm("rollback", RELEASE, "1", "-n", RELEASE_NAMESPACE, "--wait", *kubeconfig)
        assert "Upgraded" not in columns()
        assert ready()
        history = helm("history", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json", *kubeconfig)
        assert [r["status"] for r in json.loads(history.stdout)][-1] == "deployed"
    finally:
        if operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(timeout=60)
    assert "Forbidden" not in log.read_text(errors="replace")

    # uninstall: the operator and its rights go; the CRDs and the LLMService stay
    out = helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", *kubeconfig).stdout
    assert "kept due to the resource policy" in out
    assert all(crd(name) is not None for name in CRDS)
    assert kube.get("llmservice", "smollm2", APPS) is not None
    assert kube.get("deployment", f"{RELEASE}-operator", RELEASE_NAMESPACE) is None
    assert kube.run("get", "clusterrole", f"{RELEASE}-operator", check=False).returncode != 0

    # a second install watching one namespace, with the CRDs left as they are: a Role in
    # that namespace, and no rights anywhere else
    helm(
        "install", "scoped", str(CHART), "-n", "scoped-ops", "--create-namespace", "--wait",
        "--set", "crds.install=false", "--set", f"operator.watchNamespaces={{{APPS}}}",
        *kubeconfig,
    )  # fmt: skip
    scoped = "system:serviceaccount:scoped-ops:scoped-hybridllm-operator"
    kube.run("create", "namespace", "elsewhere")
    assert _can_i(kube, scoped, "patch", "deployments.apps", "-n", APPS)
    assert _can_i(kube, scoped, "watch", "llmservices.hybridllm.io", "-n", APPS)
    assert not _can_i(kube, scoped, "patch", "deployments.apps", "-n", "elsewhere")
    assert not _can_i(kube, scoped, "list", "llmservices.hybridllm.io", "-A")
    assert not _can_i(kube, scoped, "list", "pods", "-A")
    assert kube.get("llmservice", "smollm2", APPS) is not None
