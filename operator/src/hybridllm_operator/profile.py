"""`hybridllm profile`: measure what one replica of a pool sustains, before traffic, and
print the ``capacity`` block for the manifest (as Dynamo's profiler does for its planner).

Two phases against one replica's OpenAI-compatible API, as Dynamo's profiler separates
them, every prompt unique (no prefix cache helps):
- prefill: one request at a time, prompts of a few sizes; the times to first token go into
  the estimator the gateway learns each replica's speed with (`hybridllm_common.speed`),
  whose prompt term is the prefill rate;
- decode: at each concurrency in turn (1, 2, 4, ... up to the pool's slots), that many
  clients ask one streamed answer after another; the output tokens/s of the largest
  concurrency whose time between tokens meets the pool's TBT objective is the decode
  figure.
The two are ``capacity.prefillTokensPerSecond`` and ``decodeTokensPerSecond``, used by
the autoscaler as they are (`llmservice.autoscaling`).

The replica is ``--url``, or the first running replica of ``--pool`` of a local service
(``hybridllm up``); the pool's slots and objectives come from the manifest (``-f``) or
the local service's spec.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridllm_common import backend_auth, crd, speed
from hybridllm_common import cli as common_cli

POOLS = ("edge", "monolithic")  # the pools a replica serves whole answers of
FILLER = "the quick brown fox jumps over the lazy dog and "  # ~10 tokens a repeat
TIMEOUT_S = 300.0


class ProfileError(Exception):
    """The profile cannot be made (the reason says why)."""


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    slots: int
    pool_config: Any  # hybridllm_forecaster.capacity.PoolConfig, the pool as the spec sets it
    where: str  # what the replica is, for the report
    token: str | None = None  # the backend token a runtime behind a gateway answers to


def _prompt(repeats: int) -> str:
    # a unique opening: a prefix cache holds nothing of it
    return f"[{secrets.token_hex(6)}] " + FILLER * repeats + "\nSay one word."


async def _one(
    session: Any, url: str, model: str, prompt: str, max_tokens: int, load: int
) -> speed.Answer:
    """One streamed answer, timed; its prompt tokens from the usage the server sends."""
    body = {
        "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }  # fmt: skip
    start = time.perf_counter()
    first = last = None
    chunks, prompt_tokens, output_tokens = 0, None, None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise ProfileError(f"{url} answered {resp.status}: {text}")
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage")
            if usage:
                prompt_tokens = int(usage.get("prompt_tokens") or 0)
                output_tokens = int(usage.get("completion_tokens") or 0)
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                now = time.perf_counter()
                first = first if first is not None else now
                last, chunks = now, chunks + 1
    if first is None or last is None:
        raise ProfileError(f"{url} streamed no token")
    if prompt_tokens is None:
        raise ProfileError(
            f"{url} sent no usage in its stream (stream_options.include_usage): the prompt's "
            "tokens cannot be counted"
        )
    return speed.Answer(
        load=load, prompt_tokens=prompt_tokens, ttft_s=first - start,
        output_tokens=output_tokens or chunks, decode_s=last - first,
    )  # fmt: skip


@dataclass(frozen=True)
class Level:
    """The answers of one concurrency of the decode sweep."""

    load: int
    answers: list[speed.Answer]

    @functools.cached_property
    def tpot_s(self) -> float:
        """The median time between tokens of its answers."""
        per = sorted(
            a.decode_s / (a.output_tokens - 1) for a in self.answers if a.output_tokens > 1
        )
        if not per:
            raise ProfileError("the answers had one token each: give a larger --max-tokens")
        return per[len(per) // 2]

    @property
    def decode_tok_s(self) -> float:
        """Output tokens per second of the replica with ``load`` answers decoding at once."""
        return self.load / self.tpot_s if self.tpot_s > 0 else 0.0


async def measure(
    url: str,
    model: str,
    levels: list[int],
    per_level: int,
    sizes: list[int],
    max_tokens: int,
    say: Any = print,
    token: str | None = None,
) -> tuple[list[speed.Answer], list[Level]]:
    """The prefill answers (one at a time, ``per_level`` of each prompt size, two output
    tokens) and the decode sweep (at each concurrency of ``levels``, ``per_level`` answers
    per client, closed loop, the smallest prompt, ``max_tokens`` each), as Dynamo's
    profiler separates the two phases."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        await _one(session, url, model, _prompt(sizes[0]), 2, 1)  # warm: not counted
        prefills = [
            await _one(session, url, model, _prompt(size), 2, 1)
            for _ in range(per_level)
            for size in sizes
        ]
        say(f"  prefill: {len(prefills)} answers, prompts of "
            f"{min(a.prompt_tokens for a in prefills)}-{max(a.prompt_tokens for a in prefills)} "
            "tokens, one at a time")  # fmt: skip
        sweep = []
        for level in levels:

            async def client(level: int = level) -> list[speed.Answer]:
                return [
                    await _one(session, url, model, _prompt(sizes[0]), max_tokens, level)
                    for _ in range(per_level)
                ]

            done = await asyncio.gather(*(client() for _ in range(level)))
            sweep.append(Level(level, [a for part in done for a in part]))
            say(f"  decode: {level:>3} at once, {1000 * sweep[-1].tpot_s:.1f} ms a token, "
                f"{sweep[-1].decode_tok_s:,.1f} output tokens/s")  # fmt: skip
    return prefills, sweep


def fit(answers: list[speed.Answer]) -> speed.ReplicaSpeed:
    """The gateway's speed model (`hybridllm_common.speed`) fitted on these answers alike
    (no forgetting: one sitting)."""
    fitted = speed.ReplicaSpeed(
        ttft=speed.Rls(3, forgetting=1.0), tpot=speed.Rls(3, forgetting=1.0)
    )
    for answer in answers:
        fitted.observe(answer)
    return fitted


def capacity(
    prefills: list[speed.Answer], sweep: list[Level], target: Target
) -> tuple[float, float, str]:
    """(prefill tokens/s, decode tokens/s, how) of one replica: the prefill rate fitted
    from the times to first token, and the output tokens/s of the largest concurrency whose
    time between tokens meets the pool's TBT objective."""
    fitted = fit(prefills)
    prefill = fitted.prefill_tokens_per_s
    if prefill is None:
        raise ProfileError(
            "the time to first token did not grow with the prompt: the prefill rate cannot "
            "be measured at these prompt sizes (give larger ones with --prompt-repeats)"
        )
    objective = float(target.pool_config.slo.tbt_s)
    meets = [lv for lv in sweep if lv.tpot_s <= objective]
    best = max(meets or sweep[:1], key=lambda lv: lv.decode_tok_s)
    how = (
        f"prefill {prefill:,.0f} tokens/s; decode {best.decode_tok_s:,.0f} tokens/s with "
        f"{best.load} at once, "
        f"{1000 * best.tpot_s:.1f} ms a token"
    )
    if meets:
        how += f" (the best concurrency within the TBT objective {objective:g} s)"
    else:
        how += (
            f": no concurrency met the TBT objective {objective:g} s, so the figure is one "
            "answer at a time's"
        )
    return prefill, best.decode_tok_s, how


def _spec_of(
    args: argparse.Namespace,
) -> tuple[crd.LLMServiceSpec | None, dict[str, Any], Path | None]:
    """The spec (from -f, else the local service's), the local service's state and its
    folder (None: no local service)."""
    state: dict[str, Any] = {}
    raw: dict[str, Any] | None = None
    service_dir: Path | None = None
    if args.file is None or args.url is None:
        from hybridllm_operator.local import cli as local_cli
        from hybridllm_operator.local import files

        try:
            service_dir = local_cli.pick_service(args)
        except LookupError as exc:
            if args.url is None:
                raise ProfileError(f"{exc} (or give --url)") from None
        else:
            state = local_cli.running_state(service_dir) or {}
            plan = service_dir / files.PLAN_FILE
            if plan.exists():
                raw = json.loads(plan.read_text()).get("spec")
    if args.file is not None:
        from hybridllm_operator.local import plan as plan_mod

        try:
            return plan_mod.load_manifest(Path(args.file)).spec, state, service_dir
        except plan_mod.ManifestError as exc:
            raise ProfileError(str(exc)) from None
    return (crd.LLMServiceSpec.model_validate(raw) if raw else None), state, service_dir


def target(args: argparse.Namespace) -> Target:
    from hybridllm_forecaster.capacity import DEFAULT_POOLS
    from hybridllm_operator.llmservice import autoscaling

    spec, state, service_dir = _spec_of(args)
    url = args.url
    where = url or ""
    token = backend_auth.load_token()
    if url is None:
        running = [
            p for p in state.get("processes") or []
            if p.get("name", "").startswith(f"{args.pool}-") and p.get("status") == "ready"
        ]  # fmt: skip
        if not running:
            raise ProfileError(
                f"no ready {args.pool} replica in the local service (`hybridllm status`); "
                "start it with `hybridllm up`, or give --url"
            )
        url = str(running[0]["url"])
        where = f"{running[0]['name']} of {state.get('name')} ({url})"
        token = _local_token(service_dir)
    if spec is None:
        config = DEFAULT_POOLS[args.pool]
        model, slots = args.model, args.slots
        if model is None or slots is None:
            raise ProfileError("without a manifest (-f) give --model and --slots")
    else:
        pool = crd.scaled_pools(spec).get(args.pool)
        if pool is None:
            raise ProfileError(f"the manifest has no {args.pool} pool")
        config = autoscaling.pool_config(args.pool, pool, spec)
        model = args.model or spec.model.served_name or ""
        slots = args.slots or autoscaling.slots(args.pool, spec)
    return Target(url.rstrip("/"), model, int(slots), config, where, token)


def _local_token(service_dir: Path | None) -> str | None:
    """The backend token of a local service (its runtimes answer nobody else), from the
    file its supervisor keeps for this user."""
    from hybridllm_operator.local import files

    if service_dir is None:
        return backend_auth.load_token()
    try:
        return (service_dir / files.TOKEN_FILE).read_text().strip() or None
    except OSError:
        return backend_auth.load_token()


def _levels(slots: int) -> list[int]:
    out, level = [], 1
    while level < slots:
        out.append(level)
        level *= 2
    return [*out, slots]


def _profile(args: argparse.Namespace) -> int:
    try:
        t = target(args)
        levels = _levels(t.slots)
        say = (lambda *_: None) if args.json else print
        say(f"profiling the {args.pool} pool's replica {t.where} ({t.model}): "
            f"{args.requests} answers per client at {', '.join(map(str, levels))} at once")  # fmt: skip
        prefills, sweep = asyncio.run(
            measure(
                t.url,
                t.model,
                levels,
                args.requests,
                args.prompt_repeats,
                args.max_tokens,
                say,
                t.token,
            )
        )
        prefill, decode, how = capacity(prefills, sweep, t)
    except (TimeoutError, ProfileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    field = "spec.edge.pool.capacity" if args.pool == "edge" else "spec.cloud.monolithic.capacity"
    result = {
        "pool": args.pool, "url": t.url, "model": t.model,
        "answers": len(prefills) + sum(len(lv.answers) for lv in sweep),
        "levels": levels, "machine": f"{platform.node()} ({platform.machine()}, "
        f"{_cores()} cores)", "prefillTokensPerSecond": round(prefill),
        "decodeTokensPerSecond": round(decode), "detail": how,
        "tpotSeconds": {str(lv.load): round(lv.tpot_s, 5) for lv in sweep},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{how}\n{field} (measured {time.strftime('%Y-%m-%d')} on {result['machine']}):")
    print(f"  capacity:\n    prefillTokensPerSecond: {result['prefillTokensPerSecond']}\n"
          f"    decodeTokensPerSecond: {result['decodeTokensPerSecond']}")  # fmt: skip
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 8,32,96") from None
    if not values or any(v < 1 or v > 10_000 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each between 1 and 10000")
    return values


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help=common_cli.summary("profile"),
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("name", nargs="?", help="the local service (default: the only one running)")
    p.add_argument("--pool", choices=POOLS, default="edge", help="the pool to measure")
    p.add_argument("--url", help="the replica's base URL (default: the local service's)")
    p.add_argument("-f", "--file", help="the manifest (default: the local service's spec)")
    p.add_argument("--model", help="the model name to ask for (default: the manifest's)")
    p.add_argument("--slots", type=int, help="requests decoded together (default: the pool's)")
    p.add_argument("--requests", type=int, default=4, help="answers per client at each level")
    p.add_argument(
        "--prompt-repeats", type=_positive_ints, default=[8, 32, 96],
        help="prompt sizes, in repeats of a ~10-token sentence (default 8,32,96)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per answer")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.add_argument("--state-root", help=argparse.SUPPRESS)
    p.set_defaults(func=_profile)
