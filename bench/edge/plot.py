"""Plot and markdown table of bench/edge/run.py's report."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["concurrency"]
    clients = [r["clients"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = range(len(clients))
    w = 0.38
    ax = axes[0]
    ax.bar(
        [i - w / 2 for i in x],
        [r["ours"]["tokens_per_s"] for r in rows],
        w,
        label="hybridllm-edge (batched slots)",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["llama_cpp_server"]["tokens_per_s"] for r in rows],
        w,
        label="llama_cpp.server",
    )
    ax.set(xticks=list(x), xticklabels=[str(c) for c in clients], xlabel="concurrent clients",
           ylabel="aggregate output tokens/s", title="Throughput")  # fmt: skip
    ax.legend()
    ax = axes[1]
    ax.bar(
        [i - w / 2 for i in x],
        [r["ours"]["p95_latency_s"] for r in rows],
        w,
        label="hybridllm-edge",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["llama_cpp_server"]["p95_latency_s"] for r in rows],
        w,
        label="llama_cpp.server",
    )
    ax.set(xticks=list(x), xticklabels=[str(c) for c in clients], xlabel="concurrent clients",
           ylabel="p95 request latency (s)", title="p95 latency")  # fmt: skip
    ax.legend()
    ax = axes[2]
    s = report["single_stream"]
    vals = [statistics.median(s["in_process_decode_tps"]), statistics.median(s["ours_decode_tps"])]
    ax.bar(["llama-cpp-python\nin-process", "hybridllm-edge\nover HTTP"], vals, color=["C1", "C0"])
    ax.set(
        ylabel="decode tokens/s (median)", title=f"Single stream (ratio {s['ratio_median']:.2f}x)"
    )
    m = report["machine"]
    fig.suptitle(
        f"SmolLM2-135M {report.get('weights', 'Q4_1')}, {report['threads']} thread(s); "
        f"{m['cores']} cores {m['cpu']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HIT_ROWS = {
    "openai_create": "openai `chat.completions.create` -> hybridllm-edge",
    "openai_raw_response": "openai `with_raw_response.create(...).parse()` -> hybridllm-edge",
    "httpx": "httpx `post(...).json()` -> hybridllm-edge",
    "openai_create_vs_replay": "openai `chat.completions.create` -> replay server (same bytes)",
    "httpx_vs_replay": "httpx `post(...).json()` -> replay server (same bytes)",
}


def _files(report: dict[str, Any]) -> str:
    ours, peer = Path(report["gguf"]).name, Path(report.get("peer_gguf", report["gguf"])).name
    if ours == peer:
        return f"`{ours}`, the same file for both"
    return f"ours `{ours}`, peer `{peer}`; single stream: `{ours}` on both sides"


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m, s, c = report["machine"], report["single_stream"], report["cache"]
    lines = [
        "# Edge runtime benchmark",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; load average at start "
        f"{', '.join(f'{v:.1f}' for v in m['load'])}, at end "
        f"{', '.join(f'{v:.1f}' for v in report.get('load_end', []))} (shared, noisy machine: "
        "compare the ratios, measured in the same run).",
        "",
        f"Command: `{report['command']}`  ",
        f"Ours: `{report['ours_command']}`  ",
        f"Peer: `{report['peer_command']}`  ",
        f"Model: SmolLM2-135M-Instruct {report.get('weights', 'Q4_1')} "
        f"({_files(report)}), {report['threads']} "
        f"CPU thread(s) for both, greedy, max_tokens {report['max_tokens']}.",
        "",
        "## Single stream (decode tokens/s, median of alternating repeats)",
        "",
        "| llama-cpp-python in-process | hybridllm-edge over HTTP | ratio (goal >= 0.95) |",
        "|---|---|---|",
        f"| {statistics.median(s['in_process_decode_tps']):.1f} | {statistics.median(s['ours_decode_tps']):.1f} "
        f"| {s['ratio_median']:.2f} |",
        "",
        "## Concurrent clients vs `python -m llama_cpp.server`",
        "",
        f"Medians over {report.get('rounds', 1)} rounds; each round measures ours then the peer at each "
        "level (both servers up, idle one costs no CPU). Each client sends "
        f"its {report.get('per_client', 2)} requests one after another, non-streamed"
        + (
            f", max_tokens {' / '.join(map(str, report['lengths']))} by request (mixed lengths)."
            if report.get("lengths")
            else "."
        ),
        "",
        "| clients | ours tok/s | peer tok/s | throughput ratio (goal >= 2 at 8) | ours p95 s | peer p95 s | p95 ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["concurrency"]:
        o, p = r["ours"], r["llama_cpp_server"]
        lines.append(
            f"| {r['clients']} | {o['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | {r['throughput_ratio']:.2f} "
            f"| {o['p95_latency_s']:.2f} | {p['p95_latency_s']:.2f} | {r['p95_ratio']:.2f} |"
        )
    lines += [
        "",
        "## Response cache hit (loopback, keep-alive, end to end; goal < 5 ms)",
        "",
        f"First (computed) answer {1000 * c['miss_s']:.0f} ms. Hits, {c['repeats']} repeats each:",
        "",
        "| client -> server | median ms | p95 ms |",
        "|---|---|---|",
        *[
            f"| {label} | {c[k]['median_ms']:.2f} | {c[k]['p95_ms']:.2f} |"
            for k, label in HIT_ROWS.items()
        ],
        "",
        f"The openai client's own cost per call (openai minus httpx, both against the replay "
        f"server): {c['openai_client_overhead_ms']:.2f} ms. Our server's share of a hit (httpx "
        f"against ours minus httpx against the replay server): {c['server_share_ms']:.2f} ms.",
        "",
        f"![plot]({path.with_suffix('.png').name})",
        "",
    ]
    path.write_text("\n".join(lines))


def plot_scaling(report: dict[str, Any], path: Path) -> None:
    """bench/edge/scaling.py: tokens/s and gain over batch 1 against the batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, per_b in report["results"].items():
        batches = [int(b) for b in per_b]
        axes[0].plot(batches, [v["tokens_per_s"] for v in per_b.values()], "o-", label=name)
        axes[1].plot(batches, [v["gain_vs_batch1"] for v in per_b.values()], "o-", label=name)
    axes[0].set(xlabel="sequences per llama_decode", ylabel="decode tokens/s (median)",
                title="One llama_decode step, all sequences")  # fmt: skip
    axes[1].axhline(2.0, color="grey", linestyle="--", label="issue goal at 8 clients")
    axes[1].set(xlabel="sequences per llama_decode", ylabel="tokens/s over batch 1",
                title="Ceiling of batched vs one-at-a-time serving")  # fmt: skip
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(
        f"SmolLM2-135M, {report['threads']} thread(s); {m['cores']} cores {m['cpu']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_scaling_markdown(report: dict[str, Any], path: Path) -> None:
    m = report["machine"]
    names = list(report["results"])
    batches = list(report["results"][names[0]])
    lines = [
        "# llama.cpp decode step against the batch size (edge runtime)",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; load average "
        f"{', '.join(f'{v:.1f}' for v in m['load'])} at start, "
        f"{', '.join(f'{v:.1f}' for v in report['load_end'])} at end (shared machine).",
        "",
        f"Command: `{report['command']}`; {report['threads']} CPU thread(s); each cell is the "
        f"median over {report['rounds']} interleaved rounds of the median of "
        f"{report['steps']} decode steps (`LlamaCppBackend.forward`, logits of every sequence).",
        "",
        "| weights | " + " | ".join(f"batch {b} ms/step" for b in batches)
        + " | " + " | ".join(f"tok/s b{b}" for b in batches)
        + " | gain b8/b1 (ceiling of the 8-client ratio) |",
        "|---|" + "---|" * (2 * len(batches) + 1),
    ]  # fmt: skip
    for name, per_b in report["results"].items():
        last = per_b[batches[-1]]
        lines.append(
            f"| {name} | " + " | ".join(f"{v['step_ms']:.1f}" for v in per_b.values())
            + " | " + " | ".join(f"{v['tokens_per_s']:.1f}" for v in per_b.values())
            + f" | {last['gain_vs_batch1']:.2f} |"
        )  # fmt: skip
    lines += [
        "",
        "A one-request-at-a-time server decodes at the batch-1 rate; a batched server at best at",
        "the batch-8 rate, less prompt processing and serving overhead. The last column is",
        "therefore the most the 8-client throughput ratio can reach with these kernels here.",
        "",
        f"![plot]({path.with_suffix('.png').name})",
        "",
    ]
    path.write_text("\n".join(lines))
