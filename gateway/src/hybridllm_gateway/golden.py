"""Golden prompts: questions a new model revision must still answer right.

The routing table lists them (``goldenPrompts``, from the LLMService's
``spec.rollout.analysis``). Every second the gateway looks for backends of a revision
other than the table's stable one (a rollout's canary) that it has not asked yet, asks
each of them every prompt directly (not through the balancer, so no client request is
involved: the canary may be at weight 0), at temperature 0, and exports the verdicts as
``hybridllm_gateway_revision_golden_prompt_passed{tier, revision, prompt}``: 1 when every
backend asked so far answered prompt ``prompt`` (its 0-based index; the log counts from
1, as the LLMService's status does) with text the ``expect`` regular
expression finds (any case), 0 when one did not. A wrong answer is logged with the
prompt, the expectation and the answer. The rollout controller reads the gauge and moves
no traffic to the canary until every prompt passed.

A backend that cannot be reached (still starting) is asked again a second later; one that
answers with an error status fails the prompt (a revision that refuses a golden question
is a wrong revision). A backend is asked once per (URL, revision, prompts): a new list of
prompts asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import aiohttp

from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import config as config_mod
from hybridllm_gateway import metrics as metrics_mod

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
TIMEOUT_S = 120.0
ANSWER_SHOWN = 200  # characters of a wrong answer in the log


class Unreachable(Exception):
    """The backend did not answer at all: ask again later."""


async def ask(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    golden: config_mod.GoldenPrompt,
    headers: dict[str, str] | None = None,
    connect: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """One golden prompt to one backend: (passed, what it answered or why it failed);
    ``connect``: a device's TLS (``balancer.tls_args``)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": golden.prompt}],
        "max_tokens": golden.max_tokens,
        "temperature": 0,
        "stream": False,
    }
    try:
        async with session.post(
            url.rstrip("/") + "/v1/chat/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
            **(connect or {}),
        ) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise Unreachable(str(exc) or type(exc).__name__) from exc
    if status != 200:
        return False, f"HTTP {status}: {text[:ANSWER_SHOWN]}"
    try:
        answer = json.loads(text)["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        return False, f"not a chat completion: {text[:ANSWER_SHOWN]}"
    return re.search(golden.expect, answer, re.IGNORECASE) is not None, answer


class GoldenChecker:
    """Asks the golden prompts of the routing table of new revisions' backends and keeps
    the verdicts in the metrics."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: metrics_mod.GatewayMetrics,
        routing: Callable[[], config_mod.RoutingConfig],
        backend_headers: dict[str, str] | None = None,
    ) -> None:
        self.session, self.metrics, self.routing = session, metrics, routing
        self.backend_headers = backend_headers or {}  # for backends in the cluster only
        # (url, revision, prompts) -> a verdict per prompt
        self.results: dict[tuple[str, str, str], list[bool]] = {}
        self.asking: dict[tuple[str, str, str], asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                try:
                    self.step()
                except Exception:  # a bug here must not end the checks for good
                    log.exception("golden prompts: checking failed; trying again")
                await asyncio.sleep(INTERVAL_S)
        finally:
            for task in self.asking.values():
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self.asking.values(), return_exceptions=True)

    def step(self) -> None:
        """Start asking the backends not asked yet, and export what is known."""
        table = self.routing()
        self.metrics.revision_golden.clear()
        if not table.golden_prompts:
            return
        prompts = json.dumps([g.model_dump() for g in table.golden_prompts], sort_keys=True)
        for tier_name, tier in table.tiers.items():
            verdicts: dict[str, list[list[bool]]] = {}
            for backend in tier.backends:
                if backend.revision == table.revision:
                    continue  # the stable revision answers clients already
                key = (backend.url, backend.revision, prompts)
                if key in self.results:
                    verdicts.setdefault(backend.revision, []).append(self.results[key])
                elif key not in self.asking:
                    self.asking[key] = asyncio.get_running_loop().create_task(
                        self._ask_all(key, tier_name, table, backend)
                    )
            for revision, per_backend in verdicts.items():
                for index in range(len(table.golden_prompts)):
                    passed = all(v[index] for v in per_backend)
                    self.metrics.revision_golden.labels(
                        tier=tier_name, revision=revision, prompt=str(index)
                    ).set(1 if passed else 0)

    async def _ask_all(
        self,
        key: tuple[str, str, str],
        tier: str,
        table: config_mod.RoutingConfig,
        backend: config_mod.Backend,
    ) -> None:
        url, revision, _ = key
        headers = None if backend.device else self.backend_headers
        connect = balancer_mod.tls_args(table.device_ca, backend.server_name)
        try:
            verdicts = []
            for index, golden in enumerate(table.golden_prompts):
                passed, answer = await ask(self.session, url, table.model, golden, headers,
                                           connect)  # fmt: skip
                if not passed:
                    log.warning(
                        "golden prompt %d failed on %s (%s tier, revision %s): expected /%s/, "
                        "answered %r", index + 1, url, tier, revision, golden.expect,
                        answer[:ANSWER_SHOWN],
                    )  # fmt: skip
                verdicts.append(passed)
            self.results[key] = verdicts
            log.info(
                "golden prompts on %s (revision %s): %d of %d passed",
                url, revision, sum(verdicts), len(verdicts),
            )  # fmt: skip
        except Unreachable as exc:
            log.debug("golden prompts: %s not reachable yet (%s)", url, exc)
        finally:
            self.asking.pop(key, None)
