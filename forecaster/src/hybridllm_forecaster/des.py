"""Discrete-event simulator of one pool, request by request.

Each replica follows the model in `capacity.py`: a FIFO queue, one prompt at a time
prefilled in chunks, and a decode batch of at most ``max_batch`` sequences where every
sequence advances one token per step; a step takes ``step(b)``, plus
``chunk / prefill_tok_s`` while a prompt is being prefilled. Decoding is simulated
exactly without one event per token: each replica keeps a *token clock* ``V`` that
advances by one per step, so a sequence admitted at ``V0`` with ``n`` tokens to go
finishes when ``V`` reaches ``V0 + n``; a heap per replica holds these finishing
clocks, and events happen only at arrivals, prefill ends, sequence ends, replica
readiness and control ticks (a few per request). A prefill's duration is fixed when it
starts, from the batch size then (``tokens / prefill_tok_s + chunks * step(b)``).

Requests go to the ready replica with the fewest outstanding requests. A replica
asked for starts paying at once and serves after the cold start; a scale-down cancels
starting replicas first, then drains the least loaded ready ones (their queued
requests are sent elsewhere; running ones finish). The run continues past the last
arrival until every request has finished, so none is lost.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from hybridllm_forecaster.capacity import PoolConfig
from hybridllm_forecaster.policies import Observation, Policy
from hybridllm_forecaster.simresult import SimResult, integrate_changes
from hybridllm_forecaster.stream import RequestStream

_PREFILL_DONE, _DECODE_DONE, _READY, _CONTROL = 0, 1, 2, 3


class _Replica:
    __slots__ = ("decoding", "last_t", "prefilling", "queue", "rid", "state", "v", "version")

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.state = "starting"  # starting -> ready -> draining -> gone
        self.queue: deque[int] = deque()
        self.prefilling = -1
        self.decoding: list[tuple[float, int]] = []  # (finish token clock, request)
        self.v = 0.0
        self.last_t = 0.0
        self.version = 0

    def outstanding(self) -> int:
        return len(self.queue) + (self.prefilling >= 0) + len(self.decoding)


class PoolSimulator:
    """One run of one policy over one request stream."""

    def __init__(self, stream: RequestStream, pool: PoolConfig, policy: Policy) -> None:
        self.s = stream
        self.pool = pool
        self.policy = policy
        self.max_batch = pool.max_batch
        self.do_prefill = pool.role != "decode"
        self.do_decode = pool.role != "prefill"
        n = stream.num_requests
        self.ttft = np.full(n, np.nan)
        self.tbt = np.zeros(n)
        self.done = np.full(n, np.nan)
        self.decode_start = np.zeros(n)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.replicas: dict[int, _Replica] = {}
        self.next_rid = 0
        self.pending: deque[int] = deque()
        self.changes: list[tuple[float, int]] = []
        self.num_done = 0
        # running totals of what arrived, for the work of any span of arrivals
        self.cum = np.stack([
            np.concatenate([[0.0], np.cumsum(stream.input_tokens, dtype=float)]),
            np.concatenate([[0.0], np.cumsum(stream.output_tokens, dtype=float)]),
            np.concatenate([[0.0], np.cumsum(pool.capacity.prompt_chunks(stream.input_tokens))]),
        ])  # fmt: skip

    def _work(self, a: np.ndarray | int, b: np.ndarray | int, dt: float) -> np.ndarray:
        """Work per second of arrivals [a, b) spread over `dt` seconds (`PoolConfig.work_per_s`)."""
        tin, tout, chunks = (self.cum[:, b] - self.cum[:, a]) / dt
        count = (np.asarray(b) - np.asarray(a)) / dt
        return self.pool.work_per_s(tin, tout, count, chunks_per_s=chunks)

    # ---- events and replicas -------------------------------------------------------
    def _push(self, t: float, kind: int, rid: int = -1, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, rid, version))

    def _paid(self) -> int:
        return sum(1 for r in self.replicas.values() if r.state != "gone")

    def _record(self, now: float) -> None:
        paid = self._paid()
        if not self.changes or self.changes[-1][1] != paid:
            if self.changes and self.changes[-1][0] == now:
                self.changes[-1] = (now, paid)
            else:
                self.changes.append((now, paid))

    def _add_replica(self, now: float, ready: bool) -> None:
        r = _Replica(self.next_rid)
        self.next_rid += 1
        self.replicas[r.rid] = r
        if ready:
            r.state = "ready"
            r.last_t = now
        else:
            self._push(now + self.pool.cold_start_s, _READY, r.rid)

    def _step_s(self, r: _Replica) -> float:
        """Seconds per token of the running batch; call before the replica's state changes."""
        cap = self.pool.capacity
        chunk = cap.prefill_chunk_tokens / cap.prefill_tok_s if r.prefilling >= 0 else 0.0
        return cap.step_s(len(r.decoding)) + chunk

    def _advance(self, r: _Replica, now: float) -> None:
        if r.decoding:
            r.v += (now - r.last_t) / self._step_s(r)
        r.last_t = now

    def _schedule_decode(self, r: _Replica, now: float) -> None:
        r.version += 1
        if r.decoding:
            t = now + max(0.0, r.decoding[0][0] - r.v) * self._step_s(r)
            self._push(t, _DECODE_DONE, r.rid, r.version)

    def _try_start(self, r: _Replica, now: float) -> None:
        """Start the next prefill (or admit to decode) when the replica has a free slot."""
        while r.queue and r.prefilling < 0 and len(r.decoding) < self.max_batch:
            i = r.queue.popleft()
            if self.do_prefill:
                self._advance(r, now)
                r.prefilling = i
                cap = self.pool.capacity
                tokens = int(self.s.input_tokens[i])
                chunks = -(-tokens // cap.prefill_chunk_tokens)
                dur = tokens / cap.prefill_tok_s
                if r.decoding:
                    dur += chunks * cap.step_s(len(r.decoding))
                self._push(now + dur, _PREFILL_DONE, r.rid)
            else:
                self._first_token(r, i, now)
        self._schedule_decode(r, now)

    def _first_token(self, r: _Replica, i: int, now: float) -> None:
        self.ttft[i] = now - self.s.arrival_s[i]
        remaining = int(self.s.output_tokens[i]) - 1
        if not self.do_decode or remaining <= 0:
            self._finish(i, now)
            return
        self._advance(r, now)
        self.decode_start[i] = now
        heapq.heappush(r.decoding, (r.v + remaining, i))

    def _finish(self, i: int, now: float) -> None:
        self.done[i] = now
        self.num_done += 1
        out = int(self.s.output_tokens[i])
        if self.do_decode and out > 1:
            self.tbt[i] = (now - self.decode_start[i]) / (out - 1)

    def _route(self, i: int, now: float) -> None:
        best: _Replica | None = None
        for r in self.replicas.values():
            if r.state == "ready" and (best is None or r.outstanding() < best.outstanding()):
                best = r
        if best is None:
            self.pending.append(i)
            return
        best.queue.append(i)
        self._try_start(best, now)

    def _maybe_retire(self, r: _Replica, now: float) -> None:
        if r.state == "draining" and r.outstanding() == 0:
            r.state = "gone"
            self._record(now)

    # ---- control -------------------------------------------------------------------
    def _control(self, now: float, arrived_until: int, arrived_from: int) -> None:
        dt = self.pool.control_interval_s
        work = float(self._work(arrived_from, arrived_until, dt))
        live = [r for r in self.replicas.values() if r.state in ("starting", "ready")]
        ready = [r for r in live if r.state == "ready"]
        in_flight = len(self.pending) + sum(r.outstanding() for r in self.replicas.values())
        obs = Observation(now, len(ready), len(live), work, float(in_flight))
        desired = self.policy.decide(obs)
        if desired > len(live):
            for _ in range(desired - len(live)):
                self._add_replica(now, ready=False)
        elif desired < len(live):
            drop = len(live) - desired
            for r in sorted(live, key=lambda r: (r.state == "ready", r.outstanding(), -r.rid)):
                if drop == 0:
                    break
                drop -= 1
                if r.state == "starting":
                    r.state = "gone"
                    continue
                r.state = "draining"
                queued, r.queue = list(r.queue), deque()
                for i in queued:
                    self._route(i, now)
                self._maybe_retire(r, now)
        self._record(now)

    def run(self, initial_replicas: int | None = None) -> SimResult:
        s, pool = self.s, self.pool
        n = s.num_requests
        dt = pool.control_interval_s
        start = initial_replicas or pool.min_replicas
        for _ in range(start):
            self._add_replica(0.0, ready=True)
        self._record(0.0)
        self._push(dt, _CONTROL)
        tick_idx = [0]
        nxt = 0
        now = 0.0
        while self.num_done < n:
            t_event = self.events[0][0] if self.events else math.inf
            if nxt < n and s.arrival_s[nxt] <= t_event:
                now = float(s.arrival_s[nxt])
                self._route(nxt, now)
                nxt += 1
                continue
            now, _, kind, rid, version = heapq.heappop(self.events)
            r = self.replicas.get(rid)
            if kind == _CONTROL:
                until = int(np.searchsorted(s.arrival_s, now, side="right"))
                self._control(now, until, tick_idx[-1])
                tick_idx.append(until)
                self._push(now + dt, _CONTROL)
            elif kind == _READY and r is not None and r.state == "starting":
                r.state, r.last_t = "ready", now
                while self.pending:
                    self._route(self.pending.popleft(), now)
            elif kind == _PREFILL_DONE and r is not None:
                self._advance(r, now)  # at the slower, chunk-carrying step until now
                i, r.prefilling = r.prefilling, -1
                self._first_token(r, i, now)
                self._try_start(r, now)
                self._maybe_retire(r, now)
            elif kind == _DECODE_DONE and r is not None and version == r.version:
                self._advance(r, now)
                while r.decoding and r.decoding[0][0] <= r.v + 1e-9:
                    _, i = heapq.heappop(r.decoding)
                    self._finish(i, now)
                self._try_start(r, now)
                self._maybe_retire(r, now)
        return self._result(now, tick_idx)

    def _result(self, end: float, tick_idx: list[int]) -> SimResult:
        s, pool = self.s, self.pool
        dt = pool.control_interval_s
        end = max(end, dt)
        ttft_ok = self.ttft <= pool.slo.ttft_s + 1e-9
        single = s.output_tokens <= 1
        tbt_ok = single | (self.tbt <= pool.slo.tbt_s + 1e-9) | (not self.do_decode)
        ok = ttft_ok & tbt_ok
        # requests that miss the SLO even alone on an idle replica say nothing of a policy
        counted = pool.attainable(s.input_tokens, s.output_tokens)
        num_ticks = len(tick_idx) - 1
        times = np.arange(1, num_ticks + 1) * dt
        paid = _sample_changes(self.changes, times)
        att = np.ones(num_ticks)
        ticks = np.asarray(tick_idx)
        work = self._work(ticks[:-1], ticks[1:], dt) if num_ticks else np.zeros(0)
        for k in range(num_ticks):
            a, b = tick_idx[k], tick_idx[k + 1]
            if np.any(counted[a:b]):
                att[k] = float(np.mean(ok[a:b][counted[a:b]]))
        n, m = s.num_requests, int(np.sum(counted))
        return SimResult(
            policy=self.policy.name,
            simulator="des",
            num_requests=float(n),
            slo_attainment=float(np.mean(ok[counted])) if m else 1.0,
            ttft_attainment=float(np.mean(ttft_ok[counted])) if m else 1.0,
            tbt_attainment=float(np.mean(tbt_ok[counted])) if m else 1.0,
            replica_hours=integrate_changes(self.changes, end),
            duration_s=end,
            times_s=times,
            work_per_s=work,
            provisioned=paid,
            ready=paid,
            attainment=att,
            replica_changes=list(self.changes),
            num_completed=int(np.sum(np.isfinite(self.done))),
            ttft_p99_s=float(np.nanquantile(self.ttft, 0.99)) if n else float("nan"),
            num_unattainable=n - m,
        )


def _sample_changes(changes: list[tuple[float, int]], times: np.ndarray) -> np.ndarray:
    t = np.array([c[0] for c in changes])
    v = np.array([c[1] for c in changes], dtype=float)
    idx = np.searchsorted(t, times, side="right") - 1
    return v[np.maximum(idx, 0)]


def simulate_des(
    stream: RequestStream, pool: PoolConfig, policy: Policy, *, initial_replicas: int | None = None
) -> SimResult:
    return PoolSimulator(stream, pool, policy).run(initial_replicas)
