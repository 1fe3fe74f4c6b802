"""The autoscaler in a cluster: the operator scales LLMServices on a real control plane,
reading a real Prometheus that scrapes real gateways, while a load generator replays
compressed days through them; reactive, hybrid and predictive side by side.

What runs: the control plane of hack/testenv (etcd, kube-apiserver, controller-manager,
scheduler, kwok nodes; the cached binaries), a real Prometheus (built from the Go module
proxy, scraping every second), `hybridllm operator run` as its own process reading demand
from that Prometheus, and per mode one LLMService (``--modes``) with one real gateway
process (the routing table the operator renders for it). The gateways answer from one
token server with no slot limit: what the operator reads is the demand each gateway is
offered, and every mode is offered the same arrivals at the same moments (the load of
bench/autoscaling/replay.py: its step days or its ServeGen segment). The pools' pods are
kwok's: they become Ready as soon as the scheduler places them and nothing runs in them,
so this measures the control loop (what it asks for, and when), not the SLO a pool of
real replicas would keep; bench/autoscaling/replay.py closes that loop on real replica
processes in local mode, with the same autoscaler code.

Reported per mode, every second from the API server: the Deployment's replicas (what the
operator set), the ready replicas, and the autoscaler's reactive and predictive parts
(the LLMService's status); per rise, when each mode set the peak's replicas and when they
were ready, in seconds from the rise; per day, replica-seconds, scale changes, the most
replicas ever set (against ``maxReplicas``), seconds with the ready capacity below the
offered load; the operator's `Scaled` Events and its CPU time.

    uv run python bench/autoscaling/operator_replay.py            # ~16 min: 3 step days of 300 s
    # writes bench/results/autoscaling-operator.{md,json,png}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(HERE))
import replay  # noqa: E402
from cluster_tools import proc_cpu_s, testenv  # noqa: E402
from portable import portable  # noqa: E402
from procs import load_average  # noqa: E402

TOKENSERVER = Path(__file__).resolve().parents[1] / "tokenserver.py"

NAMESPACE = "replay"
RESULTS = ROOT / "bench" / "results" / "autoscaling-operator"
MODES = "reactive,hybrid,predictive"


def service_manifest(label: str, args: argparse.Namespace) -> dict[str, Any]:
    """The replay's LLMService (the same capacity, bounds and autoscaling), in the
    namespace, with small replicas so that every mode's maximum fits the kwok nodes."""
    doc = replay.manifest(label, args)
    doc["metadata"]["namespace"] = NAMESPACE
    doc["spec"]["edge"]["pool"]["resources"] = {"cpu": "250m", "memory": "512Mi"}
    return doc


class Api:
    """The API server over HTTPS as the testenv's admin (its client certificate)."""

    def __init__(self, cluster: Any) -> None:
        import ssl

        import httpx

        pki = cluster.state_dir / "pki"
        tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.client = httpx.Client(base_url=cluster.server, verify=tls, timeout=10)

    def items(self, path: str) -> list[dict[str, Any]]:
        r = self.client.get(path)
        r.raise_for_status()
        return list(r.json()["items"])


def sample_once(api: Api, names: dict[str, str], t: float) -> dict[str, tuple[Any, ...]]:
    """Per label: (t, pods, ready, replicas set, reactive, predictive, None); the columns
    of replay.py's samples, so that its rise arithmetic applies."""
    deployments = {
        d["metadata"]["name"]: d
        for d in api.items(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
    }
    services = {
        s["metadata"]["name"]: s
        for s in api.items(f"/apis/hybridllm.io/v1alpha1/namespaces/{NAMESPACE}/llmservices")
    }
    out = {}
    for label, name in names.items():
        d = deployments.get(f"{name}-edge") or {}
        pool = ((services.get(name) or {}).get("status") or {}).get("pools", {}).get("edge", {})
        status = d.get("status") or {}
        out[label] = (
            t, status.get("replicas", 0), status.get("readyReplicas", 0),
            (d.get("spec") or {}).get("replicas"), pool.get("reactiveReplicas"),
            pool.get("predictiveReplicas"), None,
        )  # fmt: skip
    return out


async def sample(
    api: Api, names: dict[str, str], stop: asyncio.Event, t0: float
) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {label: [] for label in names}
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        now = loop.time() - t0
        try:
            row = await asyncio.to_thread(sample_once, api, names, now)
        except Exception as exc:  # noqa: BLE001 - a missed second is reported, not fatal
            print(f"  sample at {now:.0f} s failed: {exc}", flush=True)
        else:
            for label, values in row.items():
                out[label].append(values)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return out


def scaled_events(api: Api) -> dict[str, int]:
    """The operator's `Scaled` Events per LLMService (an Event's count included)."""
    counts: dict[str, int] = {}
    for e in api.items(f"/api/v1/namespaces/{NAMESPACE}/events"):
        if e.get("reason") == "Scaled":
            name = e["involvedObject"]["name"]
            counts[name] = counts.get(name, 0) + int(e.get("count") or 1)
    return counts


def day_summary(
    samples: list[Any], window: tuple[float, float], rate_t: np.ndarray, rate: np.ndarray,
    per_replica_rps: float, max_replicas: int,
) -> dict[str, Any]:  # fmt: skip
    a, b = window
    s = np.array([x[:4] for x in samples if a <= x[0] < b and x[3] is not None], dtype=float)
    if not len(s):
        return {}
    dt = np.diff(s[:, 0], append=s[-1, 0] + 1.0)
    offered = np.interp(s[:, 0], rate_t, rate)
    return {
        "replica_seconds": float(s[:, 3] @ dt),
        "mean_replicas": float(s[:, 3] @ dt / dt.sum()),
        "max_replicas_set": int(s[:, 3].max()),
        "within_max": bool(s[:, 3].max() <= max_replicas),
        "scale_changes": int(np.count_nonzero(np.diff(s[:, 3]))),
        "under_provisioned_s": float(dt[s[:, 2] * per_replica_rps < offered].sum()),
        "lead_s": replay.lead_lag_s(s[:, 0], s[:, 2], offered, 60.0, 1.0) if len(s) > 120 else None,
    }


def rise_times(
    samples: list[Any], rise_s: float, peak: float, per_replica_rps: float
) -> dict[str, Any]:
    """When the replicas set, and the ready ones, reached the peak's and held it into the
    rise (`replay.first_carrying`: seconds from the rise; None: not within 120 s)."""
    return {
        "set_s": replay.first_carrying(samples, 3, rise_s, peak, per_replica_rps),
        "ready_s": replay.first_carrying(samples, 2, rise_s, peak, per_replica_rps),
    }


def start_gateways(
    labels: list[str], args: argparse.Namespace, work: Path, backend: str
) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    """One real gateway process per service, with the routing table the operator renders
    for its manifest (its edge tier: the token server)."""
    from hybridllm_common import crd
    from hybridllm_operator.llmservice import builders

    procs, urls = [], {}
    for label in labels:
        doc = service_manifest(label, args)
        name = doc["metadata"]["name"]
        service = builders.Service(
            name, NAMESPACE, "uid", crd.LLMServiceSpec.model_validate(doc["spec"])
        )
        table = builders.routing_config(service, {"edge": [backend]})
        routing = work / f"{name}-routing.json"
        routing.write_text(json.dumps(table))
        port = free_port()
        with (work / f"{name}-gateway.log").open("ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config", str(routing),
                 "--port", str(port), "--host", "127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        urls[label] = f"http://127.0.0.1:{port}"
    for proc, url in zip(procs, urls.values(), strict=True):
        wait_http(url + "/health", proc)
    return procs, urls


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not healthy after {timeout_s:.0f} s")


def wait_for(what: str, done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


def run(args: argparse.Namespace, labels: list[str], work: Path) -> dict[str, Any]:
    import yaml

    plane = testenv()
    state = work / "cluster"
    cluster = plane.up(state)
    procs: list[subprocess.Popen[bytes]] = []
    operator = None
    try:
        api = Api(cluster)
        kubectl = [str(plane.build() / "kubectl"), "--kubeconfig", str(cluster.kubeconfig)]
        subprocess.run([*kubectl, "apply", "--server-side", "-f", str(ROOT / "crds")], check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run([*kubectl, "wait", "--for=condition=Established",
                        "crd/llmservices.hybridllm.io"], check=True, capture_output=True)  # fmt: skip
        subprocess.run(
            [*kubectl, "create", "namespace", NAMESPACE], check=True, capture_output=True
        )
        prometheus = plane.prometheus_up(state)

        backend_port = free_port()
        with (work / "tokenserver.log").open("ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(TOKENSERVER), "--port", str(backend_port),
                 "--id", "edge", "--model", "smollm2", "--rate", str(replay.TOKEN_RATE),
                 "--ttft-s", str(replay.TTFT_S), "--default-tokens", str(replay.MAX_TOKENS)],
                stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        backend = f"http://127.0.0.1:{backend_port}"
        wait_http(backend + "/health", procs[0])
        gateways, urls = start_gateways(labels, args, work, backend)
        procs += gateways
        names = {label: replay.service_name(label) for label in labels}
        plane.prometheus_targets(state, [
            (url.removeprefix("http://"), {"namespace": NAMESPACE, "llmservice": names[label]})
            for label, url in urls.items()
        ])  # fmt: skip

        env = {
            **cluster.env,
            "HYBRIDLLM_OPERATOR_PROMETHEUS_URL": prometheus,
            "HYBRIDLLM_OPERATOR_PROMETHEUS_RATE_WINDOW_SECONDS": "5",
            "HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS": str(args.bin_s),
            "HYBRIDLLM_OPERATOR_FORECAST_SEASON_SECONDS": str(args.day_seconds),
            "HYBRIDLLM_OPERATOR_FORECAST_MODEL": args.forecast_model,
        }
        op_log = work / "operator.log"
        with op_log.open("ab") as log:
            operator = subprocess.Popen(
                [sys.executable, "-m", "hybridllm_common.cli", "operator", "run",
                 "--namespace", NAMESPACE],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        docs = "\n---\n".join(yaml.safe_dump(service_manifest(label, args)) for label in labels)
        subprocess.run([*kubectl, "apply", "-f", "-"], input=docs.encode(), check=True,
                       capture_output=True)  # fmt: skip

        def metrics_available() -> bool:
            ready = 0
            for s in api.items(f"/apis/hybridllm.io/v1alpha1/namespaces/{NAMESPACE}/llmservices"):
                conds = (s.get("status") or {}).get("conditions") or []
                ready += any(
                    c["type"] == "MetricsAvailable" and c["status"] == "True" for c in conds
                )
            return ready == len(labels)

        wait_for("every service reading its demand from Prometheus", metrics_available, 180)
        rate_t, rate, rises = replay.load_shape(args)
        duration = float(args.days * args.day_seconds)
        times = replay.arrivals(rate_t, rate, duration, args.seed)
        print(
            f"{len(times):,} arrivals over {duration:.0f} s; state and logs in {work}", flush=True
        )
        cpu0, t_start = proc_cpu_s(operator.pid), time.monotonic()

        async def go() -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
            stop = asyncio.Event()
            t0 = asyncio.get_running_loop().time()
            sampler = asyncio.create_task(sample(api, names, stop, t0))
            progress = asyncio.create_task(replay.report_progress(duration, t0, stop))
            answers = await replay.drive(urls, "smollm2", times)
            stop.set()
            await progress
            return answers, await sampler

        answers, samples = asyncio.run(go())
        operator_cpu_s = proc_cpu_s(operator.pid) - cpu0
        wall = time.monotonic() - t_start
        events = scaled_events(api)
        if operator.poll() is not None:
            raise RuntimeError(f"the operator exited with {operator.returncode}: see {op_log}")
    finally:
        if operator is not None and operator.poll() is None:
            operator.terminate()
            operator.wait(timeout=60)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        plane.down(state)
    per_replica_rps = args.slots / replay.service_s()
    windows = [(d * args.day_seconds, (d + 1) * args.day_seconds) for d in range(args.days)]
    return {
        "arrivals": len(times),
        "answered": {label: sum(r.status == 200 for r in answers[label]) for label in labels},
        "per_replica_rps": per_replica_rps,
        "days": [
            {
                label: day_summary(
                    samples[label], w, rate_t, rate, per_replica_rps, args.max_replicas
                )
                for label in labels
            }
            for w in windows
        ],
        "rises": [
            {
                label: rise_times(samples[label], at, args.peak_rps, per_replica_rps)
                for label in labels
            }
            for at in rises
        ],
        "rise_at_s": rises,
        "scaled_events": {label: events.get(names[label], 0) for label in labels},
        "operator_cpu_share": operator_cpu_s / wall,
        "rate_t": rate_t.tolist(),
        "rate": rate.tolist(),
        "samples": samples,
    }


def write(out: dict[str, Any], argv: list[str]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_suffix(".json").write_text(replay.dump_json(out))
    a, labels = out["args"], out["modes"]
    if a["shape"] == "step":
        load = (
            f"{a['days']} identical days, each played in {a['day_seconds']} s: "
            f"{replay.STEP['low']:.0%} of the peak ({a['peak_rps']} requests/s), then at "
            f"{replay.STEP['rise_at']:.0%} of the day a rise to the peak within "
            f"{replay.STEP['ramp'] * a['day_seconds']:.0f} s, held for "
            f"{replay.STEP['high_for']:.0%} of the day"
        )
    else:
        load = (
            f"the ServeGen aggregate, days {a['start_day']} to {a['start_day'] + a['days'] - 1}, "
            f"a day played in {a['day_seconds']} s, peak {a['peak_rps']} requests/s"
        )
    lines = [
        "# Autoscaling in a cluster: the operator on a real control plane and a real Prometheus",
        "",
        f"Command: `uv run python bench/autoscaling/operator_replay.py"
        f"{''.join(' ' + x for x in argv)}` ({out['date']}, {out['wall_s'] / 60:.0f} min)",
        "",
        f"Machine: {out['machine']}; load average {out['load_before']} before, "
        f"{out['load_after']} after.",
        "",
        f"Load: {load}; {out['arrivals']:,} arrivals (seed {a['seed']}), each sent to all "
        f"{len(labels)} services' gateways at the same moment (streamed chat completions of "
        f"{replay.MAX_TOKENS} tokens). The operator (`hybridllm operator run`, its own "
        "process) reads each service's demand from a real Prometheus scraping the gateways "
        "every second (5 s rate window) and sets its edge pool's Deployment replicas; the "
        "pods are kwok's (Ready once scheduled). Each pool: 1 to "
        f"{a['max_replicas']} replicas of {out['per_replica_rps']:.2f} requests/s at 100% "
        f"(the capacity of bench/autoscaling/replay.py's replicas); interval {a['interval_s']} s, "
        f"lead {a['lead_s']} s, scale-down delay {a['scale_down_delay_s']} s, target "
        f"utilisation 70% unless `mode@u`, forecast `{a['forecast_model']}` on {a['bin_s']} s "
        f"bins with a season of {a['day_seconds']} s.",
        "",
    ]
    if out["rises"]:
        lines += [
            "## The rise of each day",
            "",
            "When the operator set replicas that carry the peak at 100% and kept them into "
            "the rise, and when those were ready, in seconds from the start of the rise "
            "(negative: before it; '-': not within 120 s after it; an excursion that fell "
            "back before the rise does not count). The seasonal forecast needs two days of "
            "history: day 3 is the first it can foresee.",
            "",
            "| day | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(labels),
        ]
        for d, per in enumerate(out["rises"]):
            cells = []
            for label in labels:
                set_s, ready_s = (
                    "-" if per[label][k] is None else f"{per[label][k]:+.0f} s"
                    for k in ("set_s", "ready_s")
                )
                cells.append(f"set {set_s}, ready {ready_s}")
            lines.append(f"| {d + 1} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Every day",
        "",
        "| day | mode | replica-seconds | mean replicas | most replicas set (max "
        f"{a['max_replicas']}) | scale changes | under-provisioned (s) | ready replicas lead (+) / lag (-) the load (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, per in enumerate(out["days"]):
        for label in labels:
            r = per[label]
            if not r:
                continue
            lead = "-" if r["lead_s"] is None else f"{r['lead_s']:+.0f}"
            lines.append(
                f"| {d + 1} | {label} | {r['replica_seconds']:,.0f} | {r['mean_replicas']:.2f} | "
                f"{r['max_replicas_set']} | {r['scale_changes']} | "
                f"{r['under_provisioned_s']:.0f} | {lead} |"
            )
    changes = {
        label: sum(per[label].get("scale_changes", 0) for per in out["days"]) for label in labels
    }
    lines += [
        "",
        "## The operator",
        "",
        "- `Scaled` Events the API server still held at the end: "
        + ", ".join(f"{label} {out['scaled_events'][label]}" for label in labels)
        + " (scale changes seen in the samples over the whole run: "
        + ", ".join(f"{label} {changes[label]}" for label in labels)
        + "). hack/testenv's API server keeps Events 10 minutes (`--event-ttl=10m`), so "
        "the Events cover the last 10 minutes of the run only.",
        f"- Its CPU: {out['operator_cpu_share']:.1%} of a core over the replay, "
        f"{len(labels)} services on a {a['interval_s']} s loop (the cost at 1,000 services: "
        "bench/results/operator-scale.md).",
        "- Answered requests: "
        + ", ".join(f"{label} {out['answered'][label]:,}" for label in labels)
        + f" of {out['arrivals']:,} each.",
        "",
        f"![replicas set per mode over the run]({RESULTS.name}.png)",
        "",
        "## How to read it",
        "",
        "- This measures the control loop in a cluster: when the operator asked for "
        "capacity, from real metrics, against the same offered load. The pods run nothing, so "
        "there is no SLO here; the SLO a pool of real replicas keeps under each mode, on the "
        f"same load and autoscaler code, is bench/results/autoscaling-replay"
        f"{'-step' if a['shape'] == 'step' else ''}.md (local mode, replicas that are "
        "processes with a load time).",
        "- The forecast modes' cost is in the replica-seconds: their P90 band on compressed "
        "bins, and a forecast that flares when its model changes (at the start of day 2, "
        "with one season of history, and of day 3, when the seasonal model first fits) "
        "raise the pool for a few intervals at the low level (the plot).",
        "- Peers: `reactive` is the Kubernetes HPA's algorithm on the pool's measured load "
        "(what a user gets from an HPA on this metric); `hybrid` (the default) and "
        "`predictive` add the forecast (docs/autoscaling.md).",
        "",
    ]
    RESULTS.with_suffix(".md").write_text(portable("\n".join(lines)))


def plot(out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    need = np.array(out["rate"]) / out["per_replica_rps"]
    ax.plot(out["rate_t"], need, color="grey", lw=1, label="offered load (replicas at 100%)")
    for label in out["modes"]:
        s = np.array([x[:4] for x in out["samples"][label] if x[3] is not None], dtype=float)
        if len(s):
            ax.step(s[:, 0], s[:, 3], where="post", lw=1.2, label=f"{label}: replicas set")
    for rise in out.get("rise_at_s", []):
        ax.axvline(rise, color="black", lw=0.5, ls=":")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax.set_title("The operator's edge-pool replicas per mode (real control plane, real Prometheus)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("step", "servegen"), default="step")
    replay.add_load_arguments(p, day_seconds=300, bin_s=5.0)
    p.add_argument("--modes", default=MODES, help="a mode, or mode@u for a target utilisation u")
    args = p.parse_args(argv)
    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    if problem := replay.modes_problem(labels):
        p.error(f"--modes: {problem}")
    if args.replica != "slots" or any(replay.learns(label) for label in labels):
        # every answer here comes from one token server behind kwok's pods: there is no
        # replica whose speed could be learned, nor an engine to model
        p.error("the pods are kwok's: capacity is typed (no +auto) and --replica is slots")
    argv = sys.argv[1:] if argv is None else argv
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="autoscaling-operator-"))
    load_before, started = load_average(), time.monotonic()
    result = run(args, labels, work)
    out = {
        **replay.run_header(load_before, started),
        "args": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "modes": labels,
        **result,
    }
    write(out, argv)
    plot(out)
    print(RESULTS.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
