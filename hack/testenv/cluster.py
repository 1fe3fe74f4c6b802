#!/usr/bin/env python3
"""A real Kubernetes control plane on loopback, for tests and for trying hybridllm locally.

etcd, kube-apiserver (RBAC, TLS with generated certificates), kube-controller-manager
(Deployments get ReplicaSets and pods, owner references get garbage-collected),
kube-scheduler, and kwok, which plays the kubelets: it owns a few fake nodes (CPU nodes,
GPU nodes with ``nvidia.com/gpu`` capacity and a GPU taint, an edge node) and marks the
pods scheduled onto them Running and Ready. No container ever runs.

    python hack/testenv/cluster.py up [--state-dir DIR]     # prints the kubeconfig path
    python hack/testenv/cluster.py down [--state-dir DIR]
    python hack/testenv/cluster.py status [--state-dir DIR]

The binaries come from ``hack/testenv/build.sh`` (built once from the Go module proxy and
cached). Standard library only, plus the ``openssl`` command for certificates.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load_node_module():  # type: ignore[no-untyped-def]
    """hack/testenv/node.py (the real node), loaded by path: hack/ is not a package."""
    import importlib.util

    name = "hybridllm_testenv_node"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "node.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


node = _load_node_module()

DEFAULT_STATE_DIR = HERE.parents[1] / ".testenv"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODES = [
    # name, labels, capacity, taints
    ("kwok-cpu-0", {"hybridllm.io/pool": "cpu"}, {"cpu": "16", "memory": "64Gi", "pods": "110"}, []),
    ("kwok-cpu-1", {"hybridllm.io/pool": "cpu"}, {"cpu": "16", "memory": "64Gi", "pods": "110"}, []),
    (
        "kwok-gpu-0",
        {"hybridllm.io/pool": "gpu", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100"},
        {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
        [GPU_TAINT],
    ),
    (
        "kwok-gpu-1",
        {"hybridllm.io/pool": "gpu", "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100"},
        {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
        [GPU_TAINT],
    ),
    ("kwok-edge-0", {"hybridllm.io/pool": "edge", "hybridllm.io/edge": "true"}, {"cpu": "32", "memory": "64Gi", "pods": "110"}, []),
]


class TestEnvError(RuntimeError):
    """The control plane could not be built, started or reached; the message says which part."""


@dataclass
class Cluster:
    state_dir: Path
    kubeconfig: Path
    server: str

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}


def log(message: str) -> None:
    print(f"[testenv] {message}", file=sys.stderr, flush=True)


def build() -> Path:
    """Build (or find cached) binaries; returns their directory."""
    result = subprocess.run([str(HERE / "build.sh")], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise TestEnvError(f"hack/testenv/build.sh failed with exit code {result.returncode}; its log is above")
    return Path(result.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certs(pki: Path) -> None:
    """CA, API server serving cert, admin client cert (system:masters), service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "admin.crt").exists():
        return
    days = "3650"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "ca.key"), "-out",
             str(pki / "ca.crt"), "-days", days, "-subj", "/CN=hybridllm-testenv-ca")
    sans = "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.96.0.1"
    for name, subject, ext in (
        ("apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth"),
        ("admin", "/O=system:masters/CN=hybridllm-admin", "extendedKeyUsage=clientAuth"),
    ):
        (pki / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / f"{name}.key"), "-out",
                 str(pki / f"{name}.csr"), "-subj", subject)
        _openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"), "-CAkey",
                 str(pki / "ca.key"), "-CAcreateserial", "-out", str(pki / f"{name}.crt"), "-days", days,
                 "-extfile", str(pki / f"{name}.ext"))
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "hybridllm-testenv", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "admin", "user": {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}}],
        "contexts": [{"name": "hybridllm-testenv", "context": {"cluster": "hybridllm-testenv", "user": "admin", "namespace": "default"}}],
        "current-context": "hybridllm-testenv",
    }
    path.write_text(json.dumps(config, indent=2))


def _start(state_dir: Path, name: str, argv: list[str]) -> int:
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (state_dir / "pids").mkdir(exist_ok=True)
    (state_dir / "pids" / name).write_text(str(proc.pid))
    (state_dir / "argv").mkdir(exist_ok=True)
    (state_dir / "argv" / name).write_text(json.dumps(argv))
    return proc.pid


def _gone(pid: int, deadline: float | None) -> bool:
    """Wait (reaping our own children) until ``pid`` has exited, or the deadline passes."""
    while deadline is None or time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
    return False


def kill(state_dir: Path, component: str) -> None:
    """SIGKILL one component (a crash, not a shutdown) and reap it."""
    pid = int((state_dir / "pids" / component).read_text())
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    _gone(pid, None)


def stop(state_dir: Path, component: str, grace: float = 10) -> None:
    """SIGTERM one component's process group, SIGKILL it after ``grace`` seconds."""
    pid_file = state_dir / "pids" / component
    if not pid_file.exists():
        return
    with contextlib.suppress(ValueError, ProcessLookupError):
        pid = int(pid_file.read_text())
        os.killpg(pid, signal.SIGTERM)
        if not _gone(pid, time.monotonic() + grace):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _gone(pid, time.monotonic() + 5)
    pid_file.unlink(missing_ok=True)


def restart(cluster: "Cluster", component: str) -> None:
    """Start a killed component again with its original command line; for the API server,
    return once it answers /readyz (its data is in etcd, so nothing else is redone)."""
    state_dir = cluster.state_dir
    argv = json.loads((state_dir / "argv" / component).read_text())
    _start(state_dir, component, argv)
    if component == "kube-apiserver":
        _wait("kube-apiserver /readyz", lambda: _https_ok(f"{cluster.server}/readyz", state_dir / "pki"),
              120, state_dir, component)


def _tail(state_dir: Path, name: str, lines: int = 30) -> str:
    path = state_dir / "logs" / f"{name}.log"
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _alive(state_dir: Path, name: str) -> bool:
    pid_file = state_dir / "pids" / name
    if not pid_file.exists():
        return False
    try:
        pid = int(pid_file.read_text())
        # A child of this process that exited stays a zombie, which signal 0 still
        # reaches, until it is reaped: reap it here, or a component that died at once
        # (a port taken) is waited on until the timeout.
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return False
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError):
        return False
    return True


PORT_TAKEN = "address already in use"
UP_ATTEMPTS = 3


def _on_new_ports(what: str, start):  # type: ignore[no-untyped-def]
    """``start()`` (which picks its ports and stops what it started when it fails), again
    when a port it picked was taken before its component bound it (another process got it
    between `_free_port` and the bind), up to ``UP_ATTEMPTS`` times."""
    for attempt in range(1, UP_ATTEMPTS + 1):
        try:
            return start()
        except TestEnvError as exc:
            if attempt == UP_ATTEMPTS or PORT_TAKEN not in str(exc):
                raise
            log(f"{what}: a port was taken before it was bound; starting again on new ports ({exc})")
    raise AssertionError("unreachable")


def _wait(what: str, check, timeout: float, state_dir: Path, component: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``check`` until it is true; fail with the component's log if it dies or times out.
    The poll's delay grows to a quarter of a second, not more: an API server restarted by
    the fault tests is ready after about two seconds, and a longer step waited up to a
    second past that on each of their restarts."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        if check():
            return
        if not _alive(state_dir, component):
            raise TestEnvError(f"{component} exited while waiting for {what}:\n{_tail(state_dir, component)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    raise TestEnvError(f"timed out after {timeout:.0f}s waiting for {what}; {component} log:\n{_tail(state_dir, component)}")


def _https_ok(url: str, pki: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _kubectl(bin_dir: Path, kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        [str(bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
        input=stdin, capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise TestEnvError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _node_manifest(name: str, labels: dict[str, str], capacity: dict[str, str], taints: list[dict[str, str]]) -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                **labels,
            },
        },
        "spec": {"taints": taints},
        "status": {"allocatable": capacity, "capacity": capacity},
    }


def up(state_dir: Path = DEFAULT_STATE_DIR, bin_dir: Path | None = None, real_node: bool = False) -> Cluster:
    """Start everything and return once nodes are Ready and the default ServiceAccount exists.

    With ``real_node``, the cluster's one node is a real kubelet with containerd (see
    node.py) where pods really run, instead of kwok's fake nodes. A component that finds
    its port taken (picked free, then taken by another process before it bound it) starts
    the whole control plane again on new ports, up to three times."""
    state_dir = state_dir.resolve()
    if any(_alive(state_dir, c) for c in COMPONENTS):
        kubeconfig = state_dir / "kubeconfig"
        log(f"already running; kubeconfig {kubeconfig}")
        return Cluster(state_dir, kubeconfig, json.loads(kubeconfig.read_text())["clusters"][0]["cluster"]["server"])
    built = bin_dir or build()
    return _on_new_ports("the control plane", lambda: _up(state_dir, built, real_node))


# kwok gives its fake pods addresses in KWOK_CIDR, and nothing answers there. Whatever
# connects to one (the operator reading a gateway pod's /metrics directly, a rollout's
# analysis) would otherwise follow the default route out of the machine. While a kwok
# control plane is up, the range is routed `unreachable` on this host, so such a connect
# fails at once with "No route to host" and no packet leaves. Several control planes may
# be up at once (the tests start more than one): each holds the route with a file under
# ROUTE_HOLDERS naming its state directory, and the last one down removes the route, and
# only if a control plane added it (a route that was there before is left alone).
KWOK_CIDR = "10.0.0.0/16"
ROUTE_HOLDERS = Path("/run/hybridllm-testenv/kwok-route")


def _route_present() -> bool:
    out = subprocess.run(["ip", "route", "show", "type", "unreachable", KWOK_CIDR],
                         capture_output=True, text=True, check=False)
    return bool(out.stdout.strip())


def _route_holders() -> list[Path]:
    """The holders whose control plane may still be up (a state directory that is gone
    cannot be: its holder is stale, left by a run that was killed)."""
    held = []
    for f in sorted(ROUTE_HOLDERS.glob("*.holder")) if ROUTE_HOLDERS.exists() else []:
        if Path(f.read_text().strip()).exists():
            held.append(f)
        else:
            f.unlink(missing_ok=True)
    return held


def _holder(state_dir: Path) -> Path:
    return ROUTE_HOLDERS / (hashlib.sha256(str(state_dir).encode()).hexdigest()[:16] + ".holder")


def hold_kwok_route(state_dir: Path) -> None:
    """Route KWOK_CIDR unreachable while this control plane is up (root only; without
    root, say that connects to kwok's pod addresses would leave the machine)."""
    if os.geteuid() != 0:
        log(f"warning: not root, so kwok's pod addresses ({KWOK_CIDR}) are not routed unreachable "
            "here: a direct connect to a fake pod (the operator reading a gateway pod without "
            "Prometheus) follows the default route")
        return
    ROUTE_HOLDERS.mkdir(parents=True, exist_ok=True)
    _route_holders()  # drop stale holders first
    if not _route_present():
        subprocess.run(["ip", "route", "add", "unreachable", KWOK_CIDR], check=True)
        (ROUTE_HOLDERS / "added").write_text(KWOK_CIDR + "\n")
    _holder(state_dir).write_text(str(state_dir) + "\n")


def release_kwok_route(state_dir: Path) -> None:
    """Let go of this control plane's hold; the last holder removes the route it added."""
    if os.geteuid() != 0 or not ROUTE_HOLDERS.exists():
        return
    _holder(state_dir).unlink(missing_ok=True)
    if _route_holders() or not (ROUTE_HOLDERS / "added").exists():
        return
    if _route_present():
        subprocess.run(["ip", "route", "del", "unreachable", KWOK_CIDR], check=False)
    (ROUTE_HOLDERS / "added").unlink(missing_ok=True)
    for d in (ROUTE_HOLDERS, ROUTE_HOLDERS.parent):  # nothing of ours left in /run
        with contextlib.suppress(OSError):
            d.rmdir()


def _up(state_dir: Path, bin_dir: Path, real_node: bool) -> Cluster:
    started = time.monotonic()
    pki = state_dir / "pki"
    make_certs(pki)
    etcd_port, etcd_peer, api_port = _free_port(), _free_port(), _free_port()
    cm_port, sched_port = _free_port(), _free_port()
    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = state_dir / "kubeconfig"
    write_kubeconfig(kubeconfig, server, pki)
    cluster = Cluster(state_dir, kubeconfig, server)
    try:
        _start(state_dir, "etcd", [
            str(bin_dir / "etcd"), "--name", "testenv", "--data-dir", str(state_dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"testenv=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3),
        ])
        _start(state_dir, "kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false",
            f"--cert-dir={pki}", "--event-ttl=10m",
            # Logs, exec and port-forward: reach the kubelet at its node address (the name
            # is not in any DNS), as a client the kubelet's webhook authorizer lets in.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki / 'admin.crt'}", f"--kubelet-client-key={pki / 'admin.key'}",
        ])
        _wait("etcd /health", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), 60, state_dir, "etcd")
        _wait("kube-apiserver /readyz", lambda: _https_ok(f"{server}/readyz", pki), 120, state_dir, "kube-apiserver")
        def default_sa() -> bool:
            try:
                _kubectl(bin_dir, kubeconfig, "get", "serviceaccount", "default", "-n", "default")
            except TestEnvError:
                return False
            return True

        common = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                  f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1"]
        _start(state_dir, "kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), *common, f"--secure-port={cm_port}",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false", "--concurrent-gc-syncs=5",
        ])
        _start(state_dir, "kube-scheduler", [str(bin_dir / "kube-scheduler"), *common, f"--secure-port={sched_port}"])
        (state_dir / "bin").unlink(missing_ok=True)
        (state_dir / "bin").symlink_to(bin_dir)
        if real_node:
            node.start(
                cluster, bin_dir,
                lambda name, argv: _start(state_dir, name, argv),
                lambda what, check, timeout, component: _wait(what, check, timeout, state_dir, component),
            )
            _wait("the default ServiceAccount", default_sa, 120, state_dir, "kube-controller-manager")
            log(f"control plane and real node up in {time.monotonic() - started:.1f}s at {server}; kubeconfig {kubeconfig}")
            return cluster
        hold_kwok_route(state_dir)
        stages = state_dir / "kwok-stages.yaml"
        stages.write_text((bin_dir / "kwok-stages.yaml").read_text() + "\n---\n" + (HERE / "kwok-pod-ready-again.yaml").read_text())
        _start(state_dir, "kwok", [
            str(bin_dir / "kwok"), f"--kubeconfig={kubeconfig}", f"--config={stages}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=10.0.0.1/16", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
        ])
        nodes = "\n---\n".join(json.dumps(_node_manifest(*n)) for n in NODES)
        _kubectl(bin_dir, kubeconfig, "apply", "--server-side", "-f", "-", stdin=nodes)

        def nodes_ready() -> bool:
            out = json.loads(_kubectl(bin_dir, kubeconfig, "get", "nodes", "-o", "json"))
            ready = [
                n for n in out["items"]
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
            ]
            return len(ready) == len(NODES)

        _wait("kwok nodes Ready", nodes_ready, 120, state_dir, "kwok")

        _wait("the default ServiceAccount", default_sa, 120, state_dir, "kube-controller-manager")
    except BaseException:
        down(state_dir)
        raise
    log(f"control plane up in {time.monotonic() - started:.1f}s at {server}; kubeconfig {kubeconfig}")
    return cluster


# --------------------------------------------------------------------------- Prometheus


def build_prometheus() -> Path:
    """hack/testenv/build-prometheus.sh: the cached Prometheus binary's directory."""
    result = subprocess.run([str(HERE / "build-prometheus.sh")], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise TestEnvError(f"hack/testenv/build-prometheus.sh failed with exit code {result.returncode}; its log is above")
    return Path(result.stdout.strip())


def build_helm() -> Path:
    """hack/testenv/build-helm.sh: the cached folder holding bin/helm and plugins/ (helm-unittest)."""
    result = subprocess.run([str(HERE / "build-helm.sh")], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise TestEnvError(f"hack/testenv/build-helm.sh failed with exit code {result.returncode}; its log is above")
    return Path(result.stdout.strip())


def service_account_kubeconfig(cluster: "Cluster", namespace: str, name: str, path: Path, hours: int = 6) -> Path:
    """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` (a bound token
    from the TokenRequest API, as a pod's projected token is): what a process started with
    it may do is exactly what RBAC grants that ServiceAccount."""
    bin_dir = cluster.state_dir / "bin"
    token = _kubectl(bin_dir, cluster.kubeconfig, "create", "token", name, "-n", namespace, f"--duration={hours}h").strip()
    admin = json.loads(_kubectl(bin_dir, cluster.kubeconfig, "config", "view", "--raw", "-o", "json"))
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "testenv", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": "testenv", "user": name, "namespace": namespace}}],
        "current-context": name,
    }, indent=2))  # fmt: skip
    path.chmod(0o600)
    return path


def prometheus_up(state_dir: Path, scrape_interval: str = "1s", rule_files: list[Path] | None = None,
                  ca_file: Path | None = None, targets: Path | None = None) -> str:
    """A real Prometheus beside the control plane, scraping the targets that
    `prometheus_targets` lists (file-based discovery, re-read every second; over HTTPS,
    verified against ``ca_file``, when one is given), or those of another file_sd file
    ``targets`` (local mode's scrape-targets.json), evaluating ``rule_files``; returns its
    URL. `down` stops it with everything else."""
    bin_dir = build_prometheus()
    home = state_dir / "prometheus"
    (home / "data").mkdir(parents=True, exist_ok=True)
    if targets is None:
        targets = home / "targets.json"
        if not targets.exists():
            targets.write_text("[]")
    (home / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": "hybridllm",
            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
            **({"scheme": "https", "tls_config": {"ca_file": str(ca_file)}} if ca_file else {}),
        }],
        "rule_files": [str(p) for p in rule_files or []],
    }, indent=2))  # fmt: skip

    def start() -> str:
        port = _free_port()
        _start(state_dir, "prometheus", [
            str(bin_dir / "prometheus"), f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            # apply new targets within 200 ms, not Prometheus's default 5 s
            "--scrape.discovery-reload-interval=200ms",
        ])  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait("Prometheus /-/ready", lambda: _http_ok(f"{url}/-/ready"), 60, state_dir, "prometheus")
        except TestEnvError:
            stop(state_dir, "prometheus")
            raise
        return url

    url = _on_new_ports("Prometheus", start)
    (home / "url").write_text(url)
    return url


def prometheus_targets(state_dir: Path, targets: list[tuple[str, dict[str, str]]]) -> None:
    """What Prometheus scrapes: (host:port, labels) pairs; written atomically."""
    path = state_dir / "prometheus" / "targets.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": [t], "labels": labels} for t, labels in targets]))
    tmp.replace(path)


def down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Stop everything and remove the state directory: what was started beside the control
    plane (the demo's operator), the real node (which puts the host back as it found it),
    then the control plane in reverse start order."""
    state_dir = state_dir.resolve()
    pids_dir = state_dir / "pids"
    ours = {*COMPONENTS, *node.NODE_COMPONENTS}
    extra = sorted(p.name for p in pids_dir.glob("*") if p.name not in ours) if pids_dir.exists() else []
    for name in extra:
        stop(state_dir, name)
    if (state_dir / "node").exists():
        # Nothing may make or place a pod while the node drains: a ReplicaSet would replace
        # each deleted pod at once and the drain would wait out its deadline.
        for name in ("kube-controller-manager", "kube-scheduler"):
            stop(state_dir, name)
        if _alive(state_dir, "kube-apiserver") and (state_dir / "bin").exists():
            node.drain(Cluster(state_dir, state_dir / "kubeconfig", ""), state_dir / "bin")
        node.stop(state_dir, lambda name: stop(state_dir, name))
    for name in reversed(COMPONENTS):
        stop(state_dir, name)
    release_kwok_route(state_dir)
    if state_dir.exists():
        subprocess.run(["rm", "-rf", str(state_dir)], check=False)


def status(state_dir: Path = DEFAULT_STATE_DIR) -> int:
    state_dir = state_dir.resolve()
    names = [*COMPONENTS, *(node.NODE_COMPONENTS if (state_dir / "node").exists() else ())]
    running = {c: _alive(state_dir, c) for c in names if c != "kwok" or (state_dir / "pids" / "kwok").exists()}
    for name, alive in running.items():
        print(f"{name:26s} {'running' if alive else 'stopped'}")
    if (state_dir / "kubeconfig").exists():
        print(f"kubeconfig: {state_dir / 'kubeconfig'}")
    return 0 if all(running.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("action", choices=["build", "up", "down", "status", "load-images", "model-volume"])
    parser.add_argument("names", nargs="*", help="load-images: components (docker/NAME.Dockerfile)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--name", help="model-volume: the claim's name")
    parser.add_argument("--namespace", default="default", help="model-volume: the claim's namespace")
    parser.add_argument("--path", type=Path, help="model-volume: the node directory holding the model store")
    parser.add_argument("--real-node", action="store_true",
                        help="a real kubelet and containerd as the one node, instead of kwok's fake nodes (root)")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            print(build())
        elif args.action == "up":
            print(up(args.state_dir, real_node=args.real_node).kubeconfig)
        elif args.action == "load-images":
            state_dir = args.state_dir.resolve()
            node.load_images(Cluster(state_dir, state_dir / "kubeconfig", ""), args.names)
        elif args.action == "model-volume":
            if not args.name or not args.path:
                parser.error("model-volume needs --name and --path")
            print(json.dumps({"apiVersion": "v1", "kind": "List",
                              "items": node.model_volume(args.name, args.namespace, args.path.resolve())}))
        elif args.action == "down":
            down(args.state_dir)
        else:
            return status(args.state_dir)
    except (TestEnvError, node.NodeError) as exc:
        log(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
