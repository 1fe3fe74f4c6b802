"""The test environment's real node: containerd runs the pods that the kubelet is given,
kube-proxy makes ClusterIP Services work, CoreDNS answers NAME.NAMESPACE.svc, and the CNI
bridge plugin gives each pod an address on a pod network that reaches only this machine.

Everything the node changes on the host is recorded in ``STATE/node/host.json`` when it
starts and put back by :func:`stop`: sysctls, the node address on ``lo``, the iptables
rules, the bridge, network namespaces, mounts, cgroups, processes. Standard library only;
the binaries are Debian's (containerd, runc, the CNI plugins, iptables) and ours
(``hack/testenv/build.sh``: kubelet, kube-proxy, CoreDNS).

One real node runs on a machine at a time (the kubelet's ports and the node address are
fixed); :func:`start` says so when another one is up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

NODE_NAME = "real-0"
# kubelet refuses a loopback node IP, so the node gets an address of its own, as a /32 on
# `lo`: reachable from this machine and from the pods (they route through the bridge).
NODE_IP = "172.30.255.1"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "hllm0"
SERVICE_CIDR = "10.96.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
LABELS = {"hybridllm.io/real": "true", "hybridllm.io/pool": "cpu"}
# Image content and snapshots outlive one test session, so an image is imported once per
# machine, not once per run. Everything else lives in the state directory.
CONTAINERD_ROOT = Path(os.environ.get("HYBRIDLLM_CONTAINERD_ROOT", Path.home() / ".cache/hybridllm/containerd"))
MARKER = Path("/run/hybridllm-testenv-real-node")
IPTABLES_COMMENT = "hybridllm-testenv: pods reach only this machine"
# What the kubelet (it sets them for its own defaults), kube-proxy and the CNI bridge
# plugin (IP forwarding) change; put back when the node goes down.
SYSCTLS = (
    "net/ipv4/ip_forward",
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/conf/all/route_localnet",
)
PAUSE_IMAGE = "localhost/hybridllm/pause:1"
# Places containerd and the kubelet write whatever their configuration says (shim sockets,
# network namespaces, CNI result cache, device-plugin sockets): removed at stop when they
# did not exist before the node started.
HOST_PATHS = ("/run/containerd", "/run/netns", "/var/lib/cni", "/var/lib/kubelet", "/var/log/pods",
              "/var/lib/containerd", "/etc/cni")
# iptables chains the kubelet, kube-proxy and the bridge plugin create.
CHAIN_PREFIXES = ("KUBE-", "CNI-")
IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle")
NODE_COMPONENTS = ("containerd", "coredns", "kube-proxy", "kubelet")


class NodeError(RuntimeError):
    """The real node could not start or stop; the message says which part and why."""


def log(message: str) -> None:
    import sys

    print(f"[testenv-node] {message}", file=sys.stderr, flush=True)


def _run(*argv: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


def requirements() -> list[str]:
    """What this machine lacks for a real node; empty when it can run one."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (the kubelet and containerd manage mounts, cgroups and network namespaces)")
    for tool in ("containerd", "ctr", "runc", "iptables", "ip"):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (Debian: apt-get install containerd runc iptables iproute2)")
    if not Path("/usr/lib/cni/bridge").exists():
        missing.append("the CNI plugins (Debian: apt-get install containernetworking-plugins)")
    if shutil.which("catatonit") is None:
        missing.append("catatonit, the pause process (Debian: apt-get install catatonit)")
    return missing


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key


def _read_sysctls() -> dict[str, str]:
    out = {}
    for key in SYSCTLS:
        with contextlib.suppress(OSError):
            out[key] = _sysctl_path(key).read_text().strip()
    return out


def _default_interfaces() -> list[str]:
    """The interfaces that lead off this machine: no pod may send traffic out of them."""
    result = _run("ip", "-json", "route", "show", "default", check=False)
    routes = json.loads(result.stdout or "[]") if result.returncode == 0 else []
    return sorted({r["dev"] for r in routes if r.get("dev")})


def _forward_rule(interface: str) -> list[str]:
    return ["FORWARD", "-o", interface, "-m", "comment", "--comment", IPTABLES_COMMENT, "-j", "DROP"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _chains() -> dict[str, list[str]]:
    """'iptables/nat' -> the chains of that table that ours would be named like."""
    out = {}
    for tool in IPTABLES:
        for table in TABLES:
            result = _run(tool, "-t", table, "-S", check=False)
            out[f"{tool}/{table}"] = sorted(
                line.split()[1] for line in result.stdout.splitlines()
                if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
            )
    return out


def _remove_chains(before: dict[str, list[str]]) -> None:
    """Delete the chains ours made (and the rules jumping to them from any chain)."""
    for tool in IPTABLES:
        for table in TABLES:
            old = set(before.get(f"{tool}/{table}", []))
            rules = _run(tool, "-t", table, "-S", check=False).stdout.splitlines()
            new = {r.split()[1] for r in rules if r.startswith("-N ") and r.split()[1].startswith(CHAIN_PREFIXES)} - old
            if not new:
                continue
            for rule in rules:
                words = rule.split()
                if words[:1] == ["-A"] and words[1] not in new and "-j" in words and words[words.index("-j") + 1] in new:
                    _run(tool, "-t", table, "-D", *words[1:], check=False)
            for chain in new:
                _run(tool, "-t", table, "-F", chain, check=False)
            for chain in new:
                _run(tool, "-t", table, "-X", chain, check=False)


def _netns() -> set[str]:
    with contextlib.suppress(FileNotFoundError):
        return {p.name for p in Path("/run/netns").iterdir()}
    return set()


def _write_configs(node_dir: Path, cluster: Any) -> dict[str, Path]:
    pki = cluster.state_dir / "pki"
    paths = {
        "containerd": node_dir / "containerd.toml",
        "cni": node_dir / "cni" / "net.d" / "10-hybridllm.conflist",
        "kubelet": node_dir / "kubelet.yaml",
        "corefile": node_dir / "Corefile",
        "socket": node_dir / "containerd" / "containerd.sock",
    }
    paths["cni"].parent.mkdir(parents=True, exist_ok=True)
    paths["socket"].parent.mkdir(parents=True, exist_ok=True)
    # containerd 1.6 (Debian's). restrict_oom_score_adj: the sandbox denies a negative
    # oom_score_adj, and the pause container asks for one. No AppArmor here. The pause
    # image is built locally (no registry is reachable) and never pulled.
    paths["containerd"].write_text(f"""version = 2
root = "{CONTAINERD_ROOT / 'root'}"
state = "{node_dir / 'containerd' / 'state'}"
[grpc]
  address = "{paths['socket']}"
[ttrpc]
  address = "{paths['socket']}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{paths['cni'].parent}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # crun fails on this machine's cgroup layout; runc works. cgroupfs, as the kubelet.
        BinaryName = "runc"
        SystemdCgroup = false
""")
    # The bridge plugin: one bridge, host-local addresses, the bridge as the pods' gateway
    # (so pods reach the node address, CoreDNS and ClusterIPs through this host). No IP
    # masquerade: nothing leaves the machine (see the FORWARD rule in start()).
    paths["cni"].write_text(json.dumps({
        "cniVersion": "0.4.0",
        "name": "hybridllm-testenv",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_CIDR}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(node_dir / "cni" / "ipam"),
            },
        }],
    }, indent=2))
    # The kubelet. failCgroupV1: this machine has cgroup v1. cgroupfs: no systemd here.
    # resolvConf "": pods get the cluster DNS only, never this host's resolvers. Eviction
    # thresholds low and image GC off: the images were imported, not pulled, and an
    # evicted pod on a busy test machine is noise, not a finding.
    paths["kubelet"].write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "resolvConf": "",
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "address": NODE_IP,
        "healthzBindAddress": "127.0.0.1",
        "readOnlyPort": 0,
        "containerRuntimeEndpoint": f"unix://{paths['socket']}",
        "podLogsDir": str(node_dir / "pod-logs"),
        # The API server authenticates with its client certificate (--kubelet-client-*)
        # and is authorized by a SubjectAccessReview; anonymous requests are refused.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "maxPods": 40,
    }, indent=2))
    # CoreDNS on the node address: Service and pod names of the cluster, nothing else
    # (no forwarding: the pods have no business resolving names outside the cluster).
    paths["corefile"].write_text(f""".:53 {{
    bind {NODE_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {cluster.kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
    return paths


def start(cluster: Any, bin_dir: Path, start_process: Any, wait: Any) -> None:
    """Start the node beside a running control plane and return once it is Ready.

    ``start_process(name, argv)`` and ``wait(what, check, timeout, component)`` are the
    control plane's own (cluster.py), so the node's processes are stopped, logged and
    waited for like the others'."""
    if missing := requirements():
        raise NodeError("this machine cannot run the real node; it lacks " + "; ".join(missing))
    if MARKER.exists():
        other = Path(MARKER.read_text().strip())
        if (other / "pids" / "kubelet").exists() or (other / "pids" / "containerd").exists():
            raise NodeError(
                f"a real node is already running for {other} (one per machine); stop it with "
                f"`python hack/testenv/cluster.py down --state-dir {other.parent}`"
            )
    node_dir = cluster.state_dir / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    MARKER.write_text(str(node_dir))
    host: dict[str, Any] = {
        "sysctls": _read_sysctls(),
        "netns_before": sorted(_netns()),
        "paths_before": [p for p in HOST_PATHS if os.path.lexists(p)],
        "chains_before": _chains(),
        "lo_address_added": False,
        "forward_rules": [],
    }
    record = lambda: (node_dir / "host.json").write_text(json.dumps(host, indent=2))  # noqa: E731
    record()
    # Each change is recorded before it is made (stop() undoes what is recorded and
    # tolerates a change that never happened), so a failure half-way leaves nothing behind.
    addresses = _run("ip", "-json", "addr", "show", "dev", "lo").stdout
    if NODE_IP not in addresses:
        host["lo_address_added"] = True
        record()
        _run("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
    # The bridge plugin turns IP forwarding on; nothing may be forwarded off the machine.
    for interface in _default_interfaces():
        host["forward_rules"].append(interface)
        record()
        _run("iptables", "-I", *_forward_rule(interface))

    paths = _write_configs(node_dir, cluster)
    start_process("containerd", ["containerd", "--config", str(paths["containerd"])])
    wait("containerd's socket", lambda: paths["socket"].exists(), 60, "containerd")
    ensure_pause_image(paths["socket"])
    start_process("coredns", [str(bin_dir / "coredns"), "-conf", str(paths["corefile"])])
    labels = ",".join(f"{k}={v}" for k, v in LABELS.items())
    start_process("kubelet", [
        str(bin_dir / "kubelet"), f"--config={paths['kubelet']}", f"--kubeconfig={cluster.kubeconfig}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", f"--node-labels={labels}",
        f"--root-dir={node_dir / 'kubelet'}", f"--cert-dir={node_dir / 'kubelet' / 'pki'}", "--v=1",
    ])

    def node_ready() -> bool:
        result = _run(str(bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "get", "node",
                      NODE_NAME, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    wait(f"node {NODE_NAME} Ready", node_ready, 120, "kubelet")
    # kube-proxy reads its node's address from the Node object: after the kubelet made it.
    proxy_health, proxy_metrics = _free_port(), _free_port()
    start_process("kube-proxy", [
        str(bin_dir / "kube-proxy"), f"--kubeconfig={cluster.kubeconfig}",
        f"--hostname-override={NODE_NAME}", "--proxy-mode=iptables",
        # Masquerade what reaches a ClusterIP from outside the pod network (the host).
        f"--cluster-cidr={POD_CIDR}",
        # Leave the conntrack table size and route_localnet alone: NodePorts on
        # 127.0.0.1 are not needed, and the sandbox may deny the conntrack sysctl.
        "--conntrack-max-per-core=0", "--iptables-localhost-nodeports=false",
        f"--metrics-bind-address=127.0.0.1:{proxy_metrics}", f"--healthz-bind-address=127.0.0.1:{proxy_health}",
        "--nodeport-addresses=primary", "--v=1",
    ])
    wait("kube-proxy /healthz", lambda: _http_ok(f"http://127.0.0.1:{proxy_health}/healthz"), 60, "kube-proxy")
    log(f"node {NODE_NAME} Ready at {NODE_IP} (pods {POD_CIDR}, DNS {NODE_IP})")


def model_volume(name: str, namespace: str, path: Path, size: str = "10Gi") -> list[dict[str, Any]]:
    """A PersistentVolume on this node's directory ``path`` (a model store filled
    beforehand) and the claim bound to it, for an LLMService's spec.model.cache."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-{name}"},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": f"{namespace}-{name}",
                "resources": {"requests": {"storage": size}},
            },
        },
    ]


def _ctr(socket: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ctr", "--address", str(socket), "--namespace", "k8s.io", *args, check=check)


def images(socket: Path) -> dict[str, str]:
    """Image name to manifest digest, for the images containerd holds for Kubernetes."""
    out = {}
    for line in _ctr(socket, "images", "ls").stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3:
            out[parts[0]] = parts[2]
    return out


def content(socket: Path) -> frozenset[str]:
    """The digests of the blobs containerd's content store holds."""
    return frozenset(_ctr(socket, "content", "ls", "--quiet").stdout.split())


def import_image(socket: Path, built: Any) -> bool:
    """Stream a built image (hack/images/oci.py) into containerd, unless it already holds
    that name at that digest; returns whether it imported. Layers the store already holds
    are not streamed again (after a source change only our own packages' layer is new:
    the cloud runtime's torch layer alone is gigabytes).

    Re-importing a name at a new digest drops the old image's hold on its snapshots, and
    containerd's collector may remove one of them while the unpacker, having just found it
    present, builds the next layer on it ("parent snapshot ... does not exist"). Nothing is
    lost but that step: the import is tried again (up to IMPORT_TRIES), and the next try
    finds the snapshot gone and unpacks the layer itself."""
    if images(socket).get(built.image) == built.digest:
        return False
    started = time.monotonic()
    for attempt in range(1, IMPORT_TRIES + 1):
        err = _ctr_import(socket, built, content(socket))
        if err is None:
            break
        if "does not exist" not in err or attempt == IMPORT_TRIES:
            raise NodeError(f"ctr images import of {built.image} failed: {err[-2000:]}")
        log(f"import of {built.image}: a snapshot went away mid-unpack; trying again ({err.strip()[-200:]})")
    if images(socket).get(built.image) != built.digest:
        raise NodeError(f"imported {built.image} but containerd does not list it at {built.digest}")
    log(f"imported {built.image} in {time.monotonic() - started:.0f}s")
    return True


IMPORT_TRIES = 3


def _ctr_import(socket: Path, built: Any, present: frozenset[str]) -> str | None:
    """One `ctr images import` of the layers not `present`; None when it succeeded, else
    what ctr printed."""
    proc = subprocess.Popen(
        ["ctr", "--address", str(socket), "--namespace", "k8s.io", "images", "import",
         "--snapshotter", "overlayfs", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stderr is not None
    try:
        built.write_archive(proc.stdin, present)
    except BrokenPipeError:
        pass  # ctr stopped reading: its error is on stderr
    finally:
        proc.stdin.close()
    err = proc.stderr.read()
    proc.wait()
    return None if proc.returncode == 0 else err.decode(errors="replace")


def _oci() -> Any:
    """hack/images/oci.py, the image builder (loaded by path: hack/ is not a package)."""
    import importlib.util
    import sys

    if "hybridllm_images_oci" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "hybridllm_images_oci", Path(__file__).resolve().parents[1] / "images" / "oci.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["hybridllm_images_oci"]


def ensure_pause_image(socket: Path) -> None:
    """The pod sandbox's process: Debian's catatonit, in an image of one layer."""
    import_image(socket, _oci().pause_image(PAUSE_IMAGE))


def load_images(cluster: Any, names: list[str]) -> None:
    """Build (or find cached) the named component images and import them into the node."""
    oci = _oci()
    recipes = oci.recipes()
    socket = cluster.state_dir / "node" / "containerd" / "containerd.sock"
    for name in names:
        import_image(socket, oci.build_image(recipes[name]))


def _mounts_under(*roots: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].encode().decode("unicode_escape")
        if any(target == str(r) or target.startswith(f"{r}/") for r in roots):
            out.append(target)
    return sorted(out, key=len, reverse=True)  # deepest first


def _kill_shims(socket: Path) -> None:
    """containerd's shims outlive containerd by design; ours are found by its address."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if cmdline and cmdline[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in cmdline:
                os.kill(int(proc.name), signal.SIGKILL)


def _remove_cgroups() -> None:
    """The kubelet's QoS cgroups (and anything left under them), deepest first."""
    for controller in Path("/sys/fs/cgroup").iterdir():
        top = controller / "kubepods"
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def drain(cluster: Any, bin_dir: Path, timeout: float = 60) -> None:
    """Delete every pod on the node through the API, so the kubelet stops them the normal
    way (containers, then the sandbox: CNI DEL, network namespace); best effort."""
    kubectl = [str(bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}"]
    _run(*kubectl, "delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={NODE_NAME}",
         "--grace-period=1", "--wait=false", check=False, timeout=30)
    socket = cluster.state_dir / "node" / "containerd" / "containerd.sock"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = _run("ctr", "--address", str(socket), "--namespace", "k8s.io", "tasks", "ls", check=False)
        if result.returncode != 0 or " RUNNING" not in result.stdout:
            return
        time.sleep(0.5)


def stop(state_dir: Path, stop_process: Any) -> None:
    """Stop the node's processes and put the host back as it was; idempotent, and safe on
    a node that died half-way (each step does what it can)."""
    node_dir = state_dir / "node"
    host_file = node_dir / "host.json"
    if not host_file.exists():
        return
    host = json.loads(host_file.read_text())
    socket = node_dir / "containerd" / "containerd.sock"
    for name in ("kubelet", "kube-proxy", "coredns"):
        stop_process(name)
    if socket.exists():
        tasks = _run("ctr", "--address", str(socket), "--namespace", "k8s.io", "tasks", "ls", "-q",
                     check=False).stdout.split()
        for task in tasks:
            _ctr(socket, "tasks", "kill", "--signal", "SIGKILL", task, check=False)
    stop_process("containerd")
    _kill_shims(socket)
    for target in _mounts_under(node_dir, CONTAINERD_ROOT):
        _run("umount", "-l", target, check=False)
    for name in sorted(_netns() - set(host.get("netns_before", []))):
        if name.startswith("cni-"):
            _run("umount", f"/run/netns/{name}", check=False)
            with contextlib.suppress(OSError):
                (Path("/run/netns") / name).unlink()
    _run("ip", "link", "del", BRIDGE, check=False)
    bin_dir = state_dir / "bin"
    if (bin_dir / "kube-proxy").exists():
        _run(str(bin_dir / "kube-proxy"), "--cleanup", "--proxy-mode=iptables", check=False)
    for interface in host.get("forward_rules", []):
        while _run("iptables", "-D", *_forward_rule(interface), check=False).returncode == 0:
            pass
    _remove_chains(host.get("chains_before", {}))
    for key, value in host.get("sysctls", {}).items():
        with contextlib.suppress(OSError):
            if _sysctl_path(key).read_text().strip() != value:
                _sysctl_path(key).write_text(value)
    if host.get("lo_address_added"):
        _run("ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo", check=False)
    _remove_cgroups()
    for path in HOST_PATHS:
        if path not in host.get("paths_before", []) and not _mounts_under(Path(path)):
            shutil.rmtree(path, ignore_errors=True)
    host_file.unlink()
    with contextlib.suppress(FileNotFoundError):
        if MARKER.read_text().strip() == str(node_dir):
            MARKER.unlink()
