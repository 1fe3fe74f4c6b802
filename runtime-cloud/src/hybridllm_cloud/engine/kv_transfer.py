"""The engine's disaggregation seams: ``KVTransfers``, one engine's KV transfers in both
roles. Roles (``--role``) are one engine with these two seams, not separate engines; the
server wires them (``server/app.py``):

- ``decode``: ``connector`` (a ``disagg.connector.RemotePrefillClient``, a
  ``RemotePrefill``) is asked to fill the blocks of every ``KVLoad`` the scheduler emits;
  it reports back from its own thread through ``on_remote_done``, and the next step turns
  the result into the request's first token (or, on failure, a local prefill). Prompts
  with at most ``local_prefill_threshold`` uncached tokens, or any prompt while the
  prefill pool has no capacity, stay local.
- ``prefill``: a request added with ``kv_export`` has its blocks handed, layer by layer,
  to an ``ExportSink`` (the KV server's per-transfer queue); a sink that refuses (its peer
  is gone or too slow) aborts the request at the end of the step.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridllm_cloud.engine.request import Request
from hybridllm_cloud.engine.scheduler import Scheduler
from hybridllm_cloud.outputs import EngineCoreOutput, KVLoad, TokenLogprobs
from hybridllm_cloud.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


class ExportSink(Protocol):
    """Prefill role: receives a request's blocks after each layer (engine thread)."""

    def put(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """False: the transfer is gone (peer closed, timed out); abort the request."""
        ...


@dataclass
class RemotePrefillResult:
    token: int
    logprobs: TokenLogprobs | None = None
    generator_state: torch.Tensor | None = None


class RemotePrefill(Protocol):
    """Decode role: what the engine needs of the prefill pool (see disagg.connector)."""

    def has_capacity(self) -> bool: ...

    def start(
        self, load: KVLoad, done: Callable[[str, RemotePrefillResult | None], None]
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...


class KVTransfers:
    """The remote prefills one engine started (decode role) and the blocks it exports
    (prefill role), with their counts. ``wake`` is called, from the connector's thread,
    when a remote prefill has ended."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        local_prefill_threshold: int,
        wake: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.local_prefill_threshold = local_prefill_threshold
        self.wake = wake
        self.connector: RemotePrefill | None = None
        self.done: queue.SimpleQueue[tuple[str, RemotePrefillResult | None]] = queue.SimpleQueue()
        self.sinks: dict[str, ExportSink] = {}
        self.failed_exports: set[str] = set()
        self.num_remote_prefills = 0
        self.num_local_prefills = 0
        self.num_remote_failures = 0
        runner.kv_export_sink = self.export

    # --- decode role ----------------------------------------------------------------------

    def use_remote_prefill(self, connector: RemotePrefill) -> None:
        """Long prompts are prefilled by ``connector``'s workers."""
        self.connector = connector
        threshold = self.local_prefill_threshold

        def decide(request: Request, num_uncached: int) -> bool:
            """Asked once per request, at its first admission attempt."""
            request.allow_remote_prefill = False
            remote = num_uncached > threshold and connector.has_capacity()
            if not remote:
                self.num_local_prefills += 1
            return remote

        self.scheduler.remote_prefill = decide

    def start(self, loads: list[KVLoad]) -> None:
        """The step's ``KVLoad``s, handed to the prefill pool."""
        assert self.connector is not None
        for load in loads:
            self.connector.start(load, self.on_remote_done)

    def cancel(self, request_ids: list[str]) -> None:
        """Aborted requests: their transfers in flight are cancelled."""
        for request_id in request_ids:
            if request_id in self.scheduler.remote and self.connector is not None:
                self.connector.cancel(request_id)

    def on_remote_done(self, request_id: str, result: RemotePrefillResult | None) -> None:
        """Called by the connector's thread when a transfer has ended (and stopped writing)."""
        self.done.put((request_id, result))
        self.wake()

    def has_results(self) -> bool:
        return not self.done.empty()

    def drain(self) -> list[EngineCoreOutput]:
        """The ended transfers: each a request's first token, or a local prefill."""
        outputs: list[EngineCoreOutput] = []
        while True:
            try:
                request_id, result = self.done.get_nowait()
            except queue.Empty:
                return outputs
            if result is None:
                self.num_remote_failures += 1
                self.scheduler.fail_remote_prefill(request_id)
                continue
            self.num_remote_prefills += 1
            core = self.scheduler.finish_remote_prefill(request_id, result.token, result.logprobs)
            if core is None:
                continue
            if result.generator_state is not None and core.finish_reason is None:
                try:
                    self.runner.set_generator_state(request_id, result.generator_state)
                except (RuntimeError, ValueError) as exc:  # e.g. prefill ran on another device
                    log.warning("%s: generator state not usable (%s); reseeding", request_id, exc)
            outputs.append(core)

    # --- prefill role ---------------------------------------------------------------------

    def export(
        self, request_id: str, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The runner's sink: one layer of a request's blocks, to the request's ``sinks``."""
        sink = self.sinks.get(request_id)
        if (
            sink is not None
            and request_id not in self.failed_exports
            and not sink.put(layer, first_block, k, v)
        ):
            self.failed_exports.add(request_id)

    def take_failed_exports(self) -> list[str]:
        """The requests whose sink refused since the last call (the engine aborts them)."""
        failed = list(self.failed_exports)
        self.failed_exports.clear()
        return failed
