"""Projection to the published scale: replicas per pool and cost per million tokens for the
monolithic, disaggregated and hybrid architectures, sized by the forecaster's
request-level simulator calibrated with per-replica capacities measured here.

    uv run python bench/hybrid/project.py [--sessions 12000] [--requests-per-day 2400000]

1. **Calibration** (measured on this machine, one replica type at a time, one core each):
   the cloud engine (fp32 SmolLM2-135M-Instruct, one torch thread) and the edge backend
   (llama.cpp, the ``LLMService`` default Q4_K_M, one thread): prefill tokens/s on an
   uncached ``--calibration-prompt``-token prompt, and the decode step's time at batches 1,
   8 and 32 (edge: 1, 8 and 16, its slot count), medians of ``--calibration-rounds``. Each
   gives a ``hybridllm_forecaster.capacity.CapacityModel`` (``from_benchmark``: a step that
   grows linearly with the batch).
2. **Load**: the SWE-agent trajectories at full size (``hybridllm_forecaster.sessions``:
   tokens = characters / 4), their calls arriving as a Poisson process at the published
   request rate (``--requests-per-day`` / 86,400 per second, times ``--peak-factor``),
   each call drawn from the trajectories' calls. A call's prefill is only what is new
   since the session's previous call (its history stays in the prefix cache: a session's
   calls go to the replica that holds it, as the gateway's session affinity does), or,
   in the *uncached* projections, the whole prompt. The concurrency is the published
   one: with the trajectories' calls per session, Little's law gives the think time
   between calls that keeps ``--sessions`` sessions in flight, and so how much KV a cache
   of every session's history needs (reported beside the projections: it decides which
   of the two is realistic).
3. **Sizing**: each pool is the smallest fixed number of replicas whose simulated SLO
   attainment (``simulate_des``: TTFT and TBT per request) over ``--window-s`` seconds of
   that load reaches ``--attainment``, found by bisection:
   - ``monolithic``: one pool of cloud replicas;
   - ``disaggregated``: a prefill pool and a decode pool of cloud replicas;
   - ``hybrid``: an edge pool serving ``--edge-share`` of the calls (default: the share
     the gateway's classifier chose in ``bench/results/hybrid.json``), drawn at random,
     and a cloud pool serving the rest.
4. **Cost**: every replica's cores at ``--price-per-core-hour`` over the completion
   tokens served per hour. The *gpu* projections size the cloud pools with the
   forecaster's default replica (an 8B model on one H100, **assumed, not measured**: this
   machine has no GPU) at ``--price-per-gpu-hour``, the edge pool staying on measured CPU
   replicas, at the forecaster's default SLO.

Writes bench/results/hybrid-projection.{md,json,png} (``--render PATH.json`` redraws the
report and the plot from a saved JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm_forecaster import capacity, des, policies
from hybridllm_forecaster import sessions as fsessions
from hybridllm_forecaster.stream import RequestStream

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import cost
import sessions as sessions_mod
from portable import git_head, machine_line, model_path, portable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PUBLISHED = {
    "sessions": 12_000,
    "requests_per_day": 2_400_000,
    "cost_per_million": {"monolithic": 4.80, "disaggregated": 2.10, "hybrid": 1.58},
    "throughput_rps": {"monolithic": 850, "disaggregated": 2100, "hybrid": 3570},
    "edge_share": 0.58,
}


class Static(policies.Policy):
    """A fixed number of replicas (sizing, not autoscaling)."""

    name = "static"

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, obs: policies.Observation) -> int:
        return self.replicas


# --- load -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calls:
    """Every call of the trajectories: what it prefills (cached history or whole) and
    generates; and the sessions' mean calls and model tokens, for Little's law."""

    prefill: np.ndarray
    output: np.ndarray
    calls_per_session: float


def load_calls(prefix_cache: bool, directory: Path = sessions_mod.SWE_AGENT) -> Calls:
    shapes = fsessions.load_sessions(directory)
    prefill: list[int] = []
    output: list[int] = []
    for shape in shapes:
        for i, (inp, out) in enumerate(zip(shape.input_tokens, shape.output_tokens, strict=True)):
            new = inp
            if prefix_cache and i:  # the previous call's prompt and answer are cached
                new = inp - shape.input_tokens[i - 1] - shape.output_tokens[i - 1]
            prefill.append(max(new, 1))
            output.append(max(out, 1))
    return Calls(np.array(prefill), np.array(output), len(prefill) / len(shapes))


def think_time_s(
    sessions: int, rate_per_s: float, calls_per_session: float, model_s: float
) -> float:
    """Little's law: ``sessions`` in flight at ``rate_per_s`` calls/s need each session to
    last sessions / (rate / calls) seconds; what its calls do not take is think time."""
    if rate_per_s <= 0 or calls_per_session <= 0:
        raise ValueError("rate and calls per session must be positive")
    duration = sessions / (rate_per_s / calls_per_session)
    return max(duration / calls_per_session - model_s, 0.0)


def stream(calls: Calls, rate_per_s: float, window_s: float, seed: int,
           share: float = 1.0) -> RequestStream:  # fmt: skip
    """Poisson arrivals at ``rate_per_s * share`` over ``window_s``, calls drawn at random."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate_per_s * share * window_s)
    times = np.sort(rng.uniform(0.0, window_s, n))
    pick = rng.integers(len(calls.prefill), size=n)
    return RequestStream(times, calls.prefill[pick], calls.output[pick], source="swe-agent calls")


# --- calibration -----------------------------------------------------------------------------


def calibrate_cloud(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hybridllm_cloud.engine import llm_engine
    from hybridllm_cloud.sampling_params import SamplingParams

    torch.set_num_threads(1)
    base = llm_engine.LLMEngine.from_path(model_path(args.model),
                                          llm_engine.EngineConfig(num_kv_blocks=1024, block_size=16))  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = base.model.config.vocab_size

    def fresh() -> llm_engine.LLMEngine:
        return llm_engine.LLMEngine(base.model, base.tokenizer, llm_engine.EngineConfig(
            num_kv_blocks=1024, block_size=16, max_num_batched_tokens=max(512, args.calibration_prompt),
            enable_prefix_caching=False))  # fmt: skip

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab - 100, n)]

    prefill = []
    for _ in range(args.calibration_rounds):
        engine = fresh()
        engine.add_request(
            "p", prompt(args.calibration_prompt), SamplingParams(max_tokens=1, temperature=0.0)
        )
        t0 = time.perf_counter()
        engine.step()
        prefill.append(args.calibration_prompt / (time.perf_counter() - t0))
    steps: dict[int, float] = {}
    for batch in (1, 8, 32):
        times = []
        for _ in range(args.calibration_rounds):
            engine = fresh()
            for i in range(batch):
                engine.add_request(
                    f"d{i}",
                    prompt(64),
                    SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
                )
            while engine._last_batch != (batch, batch):  # until a step is pure decode
                engine.step()
            for _ in range(2):
                engine.step()  # warm
            t0 = time.perf_counter()
            for _ in range(8):
                engine.step()
            times.append((time.perf_counter() - t0) / 8)
        steps[batch] = statistics.median(times)
    return {"prefill_tok_s": statistics.median(prefill), "step_s": steps, "kv_max_batch": 64,
            "what": "cloud engine, fp32, 1 torch thread (one core)"}  # fmt: skip


def calibrate_edge(args: argparse.Namespace) -> dict[str, Any]:
    from hybridllm_edge import backends, config
    from hybridllm_edge.backends import SlotWork

    settings = config.EdgeSettings(quantization="q4_k_m", threads=1, parallel=16,
                                   max_num_batched_tokens=256,
                                   max_model_len=max(1024, args.calibration_prompt + 128))  # fmt: skip
    backend = backends.load(settings)
    rng = np.random.default_rng(0)
    vocab = backend.info.vocab_size

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab - 100, n)]

    def reset() -> None:
        for slot in range(16):
            backend.release(slot)

    prefill = []
    for _ in range(args.calibration_rounds):
        reset()
        t0 = time.perf_counter()
        done = 0
        ids = prompt(args.calibration_prompt)
        while done < len(ids):  # in chunks of the backend's batch, as the engine sends them
            chunk = ids[done : done + 256]
            backend.forward([SlotWork(0, chunk, done, done + len(chunk) == len(ids))])
            done += len(chunk)
        prefill.append(args.calibration_prompt / (time.perf_counter() - t0))
    steps: dict[int, float] = {}
    for batch in (1, 8, 16):
        times = []
        for _ in range(args.calibration_rounds):
            reset()
            for slot in range(batch):
                backend.forward([SlotWork(slot, prompt(64), 0, True)])
            pos = 64
            work = [SlotWork(s, prompt(1), pos, True) for s in range(batch)]
            backend.forward(work)
            t0 = time.perf_counter()
            for k in range(8):
                backend.forward([SlotWork(s, prompt(1), pos + 1 + k, True) for s in range(batch)])
            times.append((time.perf_counter() - t0) / 8)
        steps[batch] = statistics.median(times)
    backend.close()
    return {"prefill_tok_s": statistics.median(prefill), "step_s": steps, "kv_max_batch": 16,
            "what": "edge backend, llama.cpp Q4_K_M, 1 thread (one core)"}  # fmt: skip


def model_of(cal: dict[str, Any]) -> capacity.CapacityModel:
    return capacity.CapacityModel.from_benchmark(
        cal["prefill_tok_s"],
        {int(k): float(v) for k, v in cal["step_s"].items()},
        cal["kv_max_batch"],
    )


# --- sizing --------------------------------------------------------------------------------------


def size_pool(s: RequestStream, pool: capacity.PoolConfig, target: float) -> dict[str, Any]:
    """The fewest replicas whose simulated SLO attainment reaches ``target`` (bisection
    between the work-based estimate's bounds)."""
    work = float(np.sum(pool.work_per_s(s.input_tokens, s.output_tokens))) / max(s.duration_s, 1.0)
    lo, hi = max(1, math.floor(work)), max(2, math.ceil(work / 0.3) + 1)

    def attain(n: int) -> des.SimResult:
        return des.simulate_des(s, pool, Static(n), initial_replicas=n)

    while attain(hi).slo_attainment < target:  # the estimate's ceiling was not enough
        lo, hi = hi, hi * 2
        if hi > 100_000:
            raise RuntimeError(f"pool {pool.name}: no size up to {hi} meets the SLO")
    best = attain(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        r = attain(mid)
        if r.slo_attainment >= target:
            hi, best = mid, r
        else:
            lo = mid + 1
    return {"replicas": hi, "slo_attainment": best.slo_attainment, "ttft_p99_s": best.ttft_p99_s,
            "work_replicas": work, "unattainable": best.num_unattainable}  # fmt: skip


def size_best_chunk(s: RequestStream, pool: capacity.PoolConfig, chunks: list[int],
                    target: float) -> dict[str, Any]:  # fmt: skip
    """A pool that prefills beside decode, sized at each step budget in ``chunks`` (prompt
    tokens per step): the fewest replicas win (small budgets keep decode steps short, large
    ones prefill faster; the best setting of a monolithic engine, as its peer deserves)."""
    best: dict[str, Any] | None = None
    for chunk in chunks:
        sized = size_pool(s, pool.with_(capacity=dataclasses.replace(pool.capacity,
                                                                     prefill_chunk_tokens=chunk)),
                          target)  # fmt: skip
        sized["chunk_tokens"] = chunk
        if best is None or sized["replicas"] < best["replicas"]:
            best = sized
    assert best is not None
    return best


def project(calls: Calls, rate: float, models: dict[str, capacity.CapacityModel], slo: capacity.Slo,
            edge_share: float, chunks: list[int], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Each architecture's pools, sized for ``rate`` calls/s."""

    def pool(name: str, role: str, model: capacity.CapacityModel) -> capacity.PoolConfig:
        return capacity.PoolConfig(name=name, role=role, capacity=model, slo=slo,  # type: ignore[arg-type]
                                   min_replicas=1, max_replicas=100_000)  # fmt: skip

    full = stream(calls, rate, args.window_s, seed=1)
    out: dict[str, Any] = {
        "monolithic": {"cloud": size_best_chunk(full, pool("cloud", "monolithic", models["cloud"]),
                                                chunks, args.attainment)},
        "disaggregated": {
            "prefill": size_pool(full, pool("prefill", "prefill", models["cloud"]), args.attainment),
            "decode": size_pool(full, pool("decode", "decode", models["cloud"]), args.attainment),
        },
        "hybrid": {
            "edge": size_best_chunk(stream(calls, rate, args.window_s, seed=2, share=edge_share),
                                    pool("edge", "monolithic", models["edge"]), chunks, args.attainment),
            "cloud": size_best_chunk(stream(calls, rate, args.window_s, seed=3, share=1 - edge_share),
                                     pool("cloud", "monolithic", models["cloud"]), chunks, args.attainment),
        },
    }  # fmt: skip
    return out


def price(arch: dict[str, Any], prices: dict[str, float], tokens_per_hour: float) -> float:
    pools = [cost.Pool(name, p["replicas"], prices[name]) for name, p in arch.items()]
    return cost.cluster_cost_per_million(pools, tokens_per_hour)


# --- report -----------------------------------------------------------------------------------


KEYS = {  # projection key -> (title, what the cloud replica is, whether history is cached)
    "cpu-cached": ("CPU replicas as measured, session history cached", "cpu", True),
    "cpu-uncached": ("CPU replicas as measured, every prompt prefilled whole", "cpu", False),
    "gpu-cached": ("GPU cloud pools (assumed capacity), session history cached", "gpu", True),
    "gpu-uncached": (
        "GPU cloud pools (assumed capacity), every prompt prefilled whole",
        "gpu",
        False,
    ),
}
# KV bytes per token: SmolLM2-135M in fp32 (30 layers x 3 KV heads x 64 x K and V x 4 bytes),
# and an 8B Llama-3 in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes)
KV_BYTES_PER_TOKEN = {"cpu": 30 * 3 * 64 * 2 * 4, "gpu": 32 * 8 * 128 * 2 * 2}


def render(r: dict[str, Any]) -> str:
    a = r["settings"]
    c = r["calls"]
    lines = [
        "# The hybrid claim projected to the published scale",
        "",
        f"- machine (calibration): {r['machine']}",
        f"- commit: {r['commit']}",
        f"- command: `{r['command']}`",
        f"- load: {a['sessions']:,} sessions in flight, {a['requests_per_day']:,} calls a day "
        f"({r['rate_per_s']:.1f}/s, peak factor {a['peak_factor']}); calls drawn from the "
        f"SWE-agent trajectories at full size ({c['count']} calls, {c['calls_per_session']:.1f} "
        f"per session; prompt mean {c['prompt_mean']:.0f} tokens, of which new since the "
        f"session's previous call {c['new_mean']:.0f}; output mean {c['output_mean']:.0f}); "
        f"Little's law: {r['think_time_s']:.0f} s between a session's calls",
        f"- keeping every session's history cached through those gaps takes "
        f"{r['kv_to_cache_tb']['cpu']:.1f} TB of KV for the 135M model (fp32) and "
        f"{r['kv_to_cache_tb']['gpu']:.1f} TB for an 8B model (bf16): the *cached* rows assume "
        "a KV store that large (Mooncake's design point), the *uncached* rows prefill every "
        "prompt whole",
        f"- sizing: the smallest fixed replica count per pool with SLO attainment >= "
        f"{a['attainment']:.0%} over {a['window_s']:.0f} s simulated (`simulate_des`, "
        "hybridllm_forecaster)",
        f"- hybrid: {a['edge_share']:.0%} of calls on the edge ({a['edge_share_source']}), at "
        "random",
        f"- pools that prefill beside decode (monolithic, edge, hybrid's cloud) are sized at "
        f"each step budget of {', '.join(map(str, a['chunk_tokens']))} prompt tokens and shown "
        "at their best (in brackets): a small budget keeps decode steps short, a large one "
        "prefills faster",
        f"- prices: ${a['price_per_core_hour']}/core-hour, ${a['price_per_gpu_hour']}/GPU-hour "
        "(round, stated prices, not quotes); cost is per million completion tokens",
        "",
        "## Calibration (measured here, one core per replica)",
        "",
        "| replica | prefill tok/s | decode step at batch (s) | decode tok/s at the CPU SLO's batch |",
        "|---|---:|---|---:|",
    ]
    for name, cal in r["calibration"].items():
        steps = ", ".join(f"{b}: {s:.3f}" for b, s in cal["step_s"].items())
        lines.append(f"| {name} ({cal['what']}) | {cal['prefill_tok_s']:.0f} | {steps} | "
                     f"{cal['decode_tok_s_at_slo']:.0f} |")  # fmt: skip
    for key, (title, _, _) in KEYS.items():
        p = r["projections"][key]
        lines += [
            "",
            f"## {title}",
            "",
            p["note"],
            "",
            "| architecture | pools: replicas (SLO attainment) | cores / GPUs | cost per million "
            "completion tokens | published |",
            "|---|---|---|---:|---:|",
        ]
        for arch in ("monolithic", "disaggregated", "hybrid"):
            pools = p["pools"][arch]
            desc = ", ".join(
                f"{n} {v['replicas']:,} ({v['slo_attainment']:.1%}"
                + (f", budget {v['chunk_tokens']}" if "chunk_tokens" in v else "")
                + ")"
                for n, v in pools.items()
            )
            lines.append(f"| {arch} | {desc} | {p['units'][arch]} | ${p['cost_per_million'][arch]:.2f} | "
                         f"${PUBLISHED['cost_per_million'][arch]:.2f} |")  # fmt: skip
    lines += ["", "## Directions", "", *r["directions"], ""]
    return "\n".join(lines)


def directions(r: dict[str, Any]) -> list[str]:
    out = []
    for key in KEYS:
        c = r["projections"][key]["cost_per_million"]
        order = sorted(c, key=c.get)
        out.append(f"- {key}: cheapest first {', '.join(f'{a} (${c[a]:.2f})' for a in order)}. Hybrid "
                   f"cheapest: {'reproduces' if order[0] == 'hybrid' else 'does not reproduce'}; "
                   f"disaggregated below monolithic: "
                   f"{'reproduces' if c['disaggregated'] < c['monolithic'] else 'does not reproduce'}.")  # fmt: skip
    out.append("- published, cheapest first: hybrid ($1.58), disaggregated ($2.10), monolithic "
               "($4.80)")  # fmt: skip
    return out


def plot(r: dict[str, Any], path: Path) -> None:
    """Cost per million completion tokens, per projection and architecture, beside the
    published costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = ("monolithic", "disaggregated", "hybrid")
    groups = [*KEYS, "published"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.26
    for i, arch in enumerate(archs):
        values = [r["projections"][k]["cost_per_million"][arch] for k in KEYS]
        values.append(PUBLISHED["cost_per_million"][arch])
        ax.bar([g + (i - 1) * width for g in range(len(groups))], values, width, label=arch)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_yscale("log")
    ax.set_ylabel("$ per million completion tokens (log)")
    ax.set_title(f"Projected to {r['settings']['sessions']:,} sessions, "
                 f"{r['settings']['requests_per_day']:,} calls a day")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF-layout directory (default: the model store's)"
    )
    ap.add_argument("--sessions", type=int, default=PUBLISHED["sessions"])
    ap.add_argument("--requests-per-day", type=int, default=PUBLISHED["requests_per_day"])
    ap.add_argument("--peak-factor", type=float, default=1.0)
    ap.add_argument("--edge-share", type=float, default=None,
                    help="share of calls on the edge (default: bench/results/hybrid.json's)")  # fmt: skip
    ap.add_argument("--window-s", type=float, default=300.0)
    ap.add_argument("--attainment", type=float, default=0.99)
    ap.add_argument("--ttft-slo", type=float, default=5.0, help="CPU replicas: TTFT objective (s)")
    ap.add_argument("--tbt-slo", type=float, default=0.25, help="CPU replicas: TBT objective (s)")
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[32, 64, 128, 512],
                    help="step budgets tried for pools that prefill beside decode (prompt tokens "
                    "per step); each such pool is sized at its best")  # fmt: skip
    ap.add_argument("--price-per-core-hour", type=float, default=0.05)
    ap.add_argument("--price-per-gpu-hour", type=float, default=2.50)
    ap.add_argument("--calibration-prompt", type=int, default=512)
    ap.add_argument("--calibration-rounds", type=int, default=3)
    ap.add_argument("--calibration", default=None, help="reuse the calibration of a previous JSON")
    ap.add_argument("--out", default=str(RESULTS / "hybrid-projection"))
    args = ap.parse_args(argv)

    share_source = "given"
    if args.edge_share is None:
        measured = json.loads((RESULTS / "hybrid.json").read_text())
        args.edge_share = float(measured["architectures"]["hybrid"]["edge_share"])
        share_source = "the share measured in bench/results/hybrid.json"
    if args.calibration:
        calibration = json.loads(Path(args.calibration).read_text())["calibration"]
    else:
        calibration = {"cloud": calibrate_cloud(args), "edge": calibrate_edge(args)}
    cpu_slo = capacity.Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)
    models = {k: model_of(v) for k, v in calibration.items()}
    for name, cal in calibration.items():
        cal["decode_tok_s_at_slo"] = models[name].decode_tok_s(cpu_slo)
    cached, whole = load_calls(True), load_calls(False)
    rate = args.requests_per_day / 86_400.0 * args.peak_factor
    out_per_hour = rate * float(np.mean(cached.output)) * 3600.0
    model_s = float(np.mean(cached.prefill)) / models["cloud"].prefill_tok_s + float(
        np.mean(cached.output)) * models["cloud"].step_s(8)  # fmt: skip
    context = float(np.mean(whole.prefill) + np.mean(whole.output))  # a session's mean context

    prices = {
        "cpu": {n: args.price_per_core_hour for n in ("cloud", "prefill", "decode", "edge")},
        "gpu": {"cloud": args.price_per_gpu_hour, "prefill": args.price_per_gpu_hour,
                "decode": args.price_per_gpu_hour, "edge": args.price_per_core_hour},
    }  # fmt: skip
    notes = {
        "cpu": f"Every replica one core at ${args.price_per_core_hour}/core-hour; SLO TTFT "
        f"{args.ttft_slo} s, TBT {args.tbt_slo} s (CPU replicas of a 135M model).",
        "gpu": "Cloud replicas: the forecaster's default (an 8B model on one H100: prefill 10k "
        "tokens/s, decode step 25 ms + 0.4 ms per sequence), **assumed, not measured** (no GPU "
        f"here), at ${args.price_per_gpu_hour}/GPU-hour and the default SLO (TTFT 2 s, TBT "
        "0.1 s); the edge pool as measured, on CPU cores at the same SLO.",
    }
    projections = {}
    for key, (_, kind, use_cache) in KEYS.items():
        print(f"  sizing {key}", file=sys.stderr, flush=True)
        pool_models = (
            models if kind == "cpu" else {"cloud": capacity.CapacityModel(), "edge": models["edge"]}
        )
        slo = cpu_slo if kind == "cpu" else capacity.Slo()
        pools = project(cached if use_cache else whole, rate, pool_models, slo, args.edge_share,
                        args.chunk_tokens, args)  # fmt: skip
        units = {
            a: ", ".join(f"{p['replicas']:,} {'cores' if kind == 'cpu' or n == 'edge' else 'GPUs'}"
                         for n, p in arch.items())
            for a, arch in pools.items()
        }  # fmt: skip
        projections[key] = {
            "note": notes[kind],
            "pools": pools,
            "units": units,
            "cost_per_million": {a: price(p, prices[kind], out_per_hour) for a, p in pools.items()},
        }
    report: dict[str, Any] = {
        "machine": machine_line(),
        "commit": git_head(),
        "command": portable(
            " ".join(["uv run python bench/hybrid/project.py", *(argv or sys.argv[1:])])
        ),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("model", "out")},
            "edge_share_source": share_source,
        },
        "rate_per_s": rate,
        "think_time_s": think_time_s(args.sessions, rate, cached.calls_per_session, model_s),
        "kv_to_cache_tb": {
            k: args.sessions * context * b / 1e12 for k, b in KV_BYTES_PER_TOKEN.items()
        },
        "calls": {
            "count": len(cached.prefill),
            "calls_per_session": cached.calls_per_session,
            "prompt_mean": float(np.mean(whole.prefill)),
            "new_mean": float(np.mean(cached.prefill)),
            "output_mean": float(np.mean(cached.output)),
        },
        "calibration": calibration,
        "projections": projections,
    }
    report["directions"] = directions(report)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=float))
    out.with_suffix(".md").write_text(render(report))
    plot(report, out.with_suffix(".png"))
    print(render(report))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:  # the report and plot again from a saved JSON
        saved = Path(sys.argv[2])
        doc = json.loads(saved.read_text())
        saved.with_suffix(".md").write_text(render(doc))
        plot(doc, saved.with_suffix(".png"))
        raise SystemExit(0)
    sys.exit(main())
