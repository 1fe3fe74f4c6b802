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
        f"SmolLM2-135M Q4_1, {report['threads']} thread(s); {m['cores']} cores {m['cpu']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m, s, c = report["machine"], report["single_stream"], report["cache"]
    lines = [
        "# Edge runtime benchmark",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; load average at start "
        f"{', '.join(f'{v:.1f}' for v in m['load'])} (shared, noisy machine: compare the ratios, "
        "measured in the same run).",
        "",
        f"Command: `{report['command']}`  ",
        f"Ours: `{report['ours_command']}`  ",
        f"Peer: `{report['peer_command']}`  ",
        f"Model: SmolLM2-135M-Instruct Q4_1 (`{Path(report['gguf']).name}`), {report['threads']} "
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
        "its requests one after another, non-streamed.",
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
        "## Response cache (openai client, loopback, end to end)",
        "",
        f"First (computed) answer {1000 * c['miss_s']:.0f} ms; cached answer median "
        f"{c['hit_median_ms']:.2f} ms, p95 {c['hit_p95_ms']:.2f} ms over {c['repeats']} repeats (goal < 5 ms).",
        "",
        f"With a plain keep-alive httpx client: median {c.get('httpx_hit_median_ms', float('nan')):.2f} ms, "
        f"p95 {c.get('httpx_hit_p95_ms', float('nan')):.2f} ms.",
        "",
        f"![plot]({path.with_suffix('.png').name})",
        "",
    ]
    path.write_text("\n".join(lines))
