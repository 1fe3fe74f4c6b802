"""Markdown table and plot of a bench/disagg/run.py result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROWS = [
    ("short_tbt_p50_ms", "interactive TBT p50 (ms)"),
    ("short_tbt_p99_ms", "interactive TBT p99 (ms)"),
    ("short_ttft_p50_ms", "interactive TTFT p50 (ms)"),
    ("short_ttft_p99_ms", "interactive TTFT p99 (ms)"),
    ("long_ttft_p50_s", "long-prompt TTFT p50 (s)"),
    ("long_ttft_p99_s", "long-prompt TTFT p99 (s)"),
    ("output_tok_s", "output tokens/s"),
    ("errors", "errors"),
]


LEGACY = (
    "- deployments: `monolithic` = one process, both cores, 2 torch threads; "
    "`disaggregated` = prefill process on core 0 + decode process on core 1 "
    "(local prefill up to {threshold} uncached tokens); `two-replicas` = two "
    "monolithic processes, one per core, least-outstanding routing"
)


def deployment_lines(report: dict[str, Any]) -> list[str]:
    described = report.get("deployments")
    if not described:  # results written before each deployment described itself
        return [LEGACY.format(threshold=report["params"]["threshold"])]
    return ["- deployments:", *(f"  - `{n}`: {what}" for n, what in described.items())]


def best(med: dict[str, dict[str, float]], key: str) -> str:
    """The deployment with the best median of ``key`` (most tokens/s, else the lowest)."""
    pick = max if key == "output_tok_s" else min
    return f"`{pick(med, key=lambda n: med[n][key])}`"


def write_report(report: dict[str, Any], out: Path) -> None:
    med = report["medians"]
    names = list(med)
    p = report["params"]
    lines = [
        "# Disaggregated vs monolithic serving (CPU, 2 cores in all)",
        "",
        f"- machine: {report['machine']}",
        f"- command: `{report['command']}` ({report['seconds'] / 60:.0f} min)",
        f"- workload per run: {p['duration']:g} s of Poisson interactive requests at "
        f"{p['short_rate']:g}/s ({p['short_len']} prompt tokens, {p['short_out']} output tokens, "
        f"streamed) plus a long prompt every {p['long_every']:g} s, length drawn from the Azure "
        f"code trace's context lengths x {p['long_scale']:g} (cap {p['long_cap']}), "
        f"{p['long_out']} output tokens; same seeded schedule for every deployment; medians "
        f"over {p['repeats']} repeats",
        *deployment_lines(report),
        "",
        "| metric | " + " | ".join(names) + " | best |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{med[n][key]:.3g}" for n in names)
                     + f" | {best(med, key) if key != 'errors' else ''} |")  # fmt: skip
    mono = [n for n in names if n.startswith("monolithic")]
    top = min(mono, key=lambda n: med[n]["short_tbt_p99_ms"]) if mono else ""
    if len(mono) > 1 and "disaggregated" in med:
        m, d = med[top], med["disaggregated"]
        lines += [
            "",
            f"The best monolithic setup for the interactive streams (lowest TBT p99) is `{top}`. "
            f"Disaggregated / `{top}`: interactive TBT p99 **{d['short_tbt_p99_ms'] / m['short_tbt_p99_ms']:.2f}x** "
            f"(goal <= 0.5x), p50 {d['short_tbt_p50_ms'] / m['short_tbt_p50_ms']:.2f}x; interactive TTFT p50 "
            f"{d['short_ttft_p50_ms'] / m['short_ttft_p50_ms']:.2f}x, p99 "
            f"{d['short_ttft_p99_ms'] / m['short_ttft_p99_ms']:.2f}x; long-prompt TTFT p50 "
            f"{d['long_ttft_p50_s'] / m['long_ttft_p50_s']:.2f}x; output tokens/s "
            f"{d['output_tok_s'] / m['output_tok_s']:.2f}x.",
        ]  # fmt: skip
    if (
        "monolithic" in med
        and "disaggregated" in med
        and not (len(mono) > 1 and top == "monolithic")
    ):
        m, d = med["monolithic"], med["disaggregated"]
        lines += [
            "",
            f"Disaggregated / monolithic: interactive TBT p99 **{d['short_tbt_p99_ms'] / m['short_tbt_p99_ms']:.2f}x** "
            f"(goal <= 0.5x), p50 {d['short_tbt_p50_ms'] / m['short_tbt_p50_ms']:.2f}x; interactive TTFT p50 "
            f"{d['short_ttft_p50_ms'] / m['short_ttft_p50_ms']:.2f}x; long-prompt TTFT p50 "
            f"{d['long_ttft_p50_s'] / m['long_ttft_p50_s']:.2f}x; output tokens/s "
            f"{d['output_tok_s'] / m['output_tok_s']:.2f}x.",
        ]
    if "two-replicas" in med and "disaggregated" in med:
        d = med["disaggregated"]
        t = med["two-replicas"]
        lines.append(
            f"Disaggregated / two replicas: TBT p99 {d['short_tbt_p99_ms'] / t['short_tbt_p99_ms']:.2f}x, "
            f"output tokens/s {d['output_tok_s'] / t['output_tok_s']:.2f}x."
        )
    if report.get("transfer"):
        lines += [
            "",
            "## KV transfer alone",
            "",
            "*warm*: a decode worker without prefix caching asks a prefill worker that already "
            "holds the prompt, so the prefill side computes the last block and ships every block; "
            "*request to DONE* is the decode side's transfer time, *first to last frame* the part "
            "in which blocks stream (it overlaps the prefill's forward pass of that last block, "
            "layer by layer). *cold*: neither side has the prompt; *local*: a monolithic process "
            "on one core prefills it. *transport alone*: the framing with checksums on loopback, "
            "one frame per layer, no model (sender and receiver in one process).",
            "",
            "| prompt tokens | KV MB | request to DONE ms | first to last frame ms | GB/s while streaming | transport alone GB/s | TTFT warm ms | transfer share of warm TTFT | TTFT cold remote ms | TTFT local ms | cold remote / local |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["transfer"]:
            lines.append(
                f"| {r['prompt_tokens']} | {r['kv_bytes'] / 1e6:.1f} | {r['transfer_s'] * 1000:.0f} | "
                f"{r['streaming_s'] * 1000:.0f} | {r['gb_per_s']:.2f} | {r.get('transport_alone_gb_per_s', float('nan')):.2f} | "
                f"{r['ttft_warm_s'] * 1000:.0f} | {r['transfer_share_of_warm_ttft']:.0%} | "
                f"{r['ttft_remote_cold_s'] * 1000:.0f} | {r['ttft_local_s'] * 1000:.0f} | "
                f"{r['ttft_remote_cold_s'] / r['ttft_local_s']:.2f}x |"
            )
    lines += ["", f"![plot]({out.name}.png)", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    _plot(report, out.with_suffix(".png"))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = report["medians"]
    names = list(med)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    x = range(len(names))
    for ax, keys, title, unit in (
        (
            axes[0],
            ("short_tbt_p50_ms", "short_tbt_p99_ms"),
            "interactive time between tokens",
            "ms",
        ),
        (axes[1], ("short_ttft_p50_ms", "short_ttft_p99_ms"), "interactive TTFT", "ms"),
    ):
        width = 0.38
        for i, key in enumerate(keys):
            ax.bar([v + (i - 0.5) * width for v in x], [med[n][key] for n in names], width,
                   label=key.rsplit("_", 2)[-2])  # fmt: skip
        ax.set_xticks(list(x), names)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend()
    ax = axes[2]
    ax.bar(list(x), [med[n]["output_tok_s"] for n in names], color="tab:green")
    ax.set_xticks(list(x), names)
    ax.set_title("output tokens/s (all requests)")
    fig.suptitle("Mixed load: short interactive streams + periodic long prompts (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
