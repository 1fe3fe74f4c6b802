"""The cloud-bound demand a site gateway refused while the cloud was unreachable, kept by
its agent until the fleet server has it (docs/sites.md, "Demand across a WAN cut").

A site gateway counts each request it refuses because the cloud tier is unreachable from
the site (``hybridllm_gateway_stranded_{prompt,completion}_tokens_total{tier="cloud"}``):
demand the cloud's gateways never saw, so the cloud's autoscaler would size its pools as
if the site had sent nothing for the minutes of the cut. The agent reads those counters
from its gateway every ``SCRAPE_S`` (on loopback), adds each increase to the minute it was
read in, and sends the minutes in its heartbeats, oldest first, ``PER_HEARTBEAT`` at a
time (the current one with its total so far); a minute leaves the ledger once a heartbeat
that carried it closed was answered 200.
During the cut the heartbeats fail too (the fleet server is across the same WAN), so the
minutes wait here; the ledger is on disk, so they also wait through a restart of the
agent, and minutes older than ``crd.STRANDED_KEEP_S`` are dropped. The fleet server adds
them up in ``EdgeFleet.status.strandedDemand``, which the autoscaler of the fleet's
LLMService adds to its cloud tier's history at the minutes they were offered.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from hybridllm_common import crd
from hybridllm_common import metrics as names
from hybridllm_edge.agent_tls import write_file

log = logging.getLogger("hybridllm_edge.agent")

SCRAPE_S = 10.0  # how often the agent reads its gateway's counters (and before each heartbeat)
PER_HEARTBEAT = 240  # minutes one heartbeat carries (the fleet server refuses more)
LEDGER = "stranded-demand.json"
_SERIES = {
    names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL: 0,
    names.GATEWAY_STRANDED_COMPLETION_TOKENS_TOTAL: 1,
}


def read_counters(text: str, tier: str = "cloud") -> tuple[float, float]:
    """The gateway's stranded (prompt, completion) token counters of ``tier``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = [0.0, 0.0]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            at = _SERIES.get(s.name)
            if at is not None and s.labels.get("tier") == tier and math.isfinite(s.value):
                out[at] += s.value
    return out[0], out[1]


class StrandedLedger:
    """Minutes of stranded demand not yet taken by the fleet server: {start: [p, c]}."""

    def __init__(self, state: Path) -> None:
        self.path = state / LEDGER
        self.bins: dict[int, list[float]] = {}
        self.last: tuple[float, float] | None = None
        try:
            saved = json.loads(self.path.read_text())
            self.bins = {int(k): [float(v[0]), float(v[1])] for k, v in saved.items()}
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            log.error("the stranded-demand ledger %s is unreadable (%s); starting empty",
                      self.path, exc)  # fmt: skip

    def observe(self, counters: tuple[float, float], now: float) -> None:
        """A read of the gateway's counters: their increase goes to this minute. The
        gateway is this agent's child, so its counters start at zero with it; a counter
        lower than the last read is a restarted gateway, counted from zero again."""
        last = self.last or (0.0, 0.0)
        increase = [
            new - old if new >= old else new for new, old in zip(counters, last, strict=True)
        ]
        self.last = counters
        if not any(x > 0 for x in increase):
            return
        start = int(now // crd.STRANDED_BIN_S * crd.STRANDED_BIN_S)
        minute = self.bins.setdefault(start, [0.0, 0.0])
        minute[0] += increase[0]
        minute[1] += increase[1]
        self._prune(now)
        self._save()

    def due(self, now: float) -> list[list[float]]:
        """The minutes a heartbeat carries, [[start, prompt, completion], ...]: the oldest
        first, the current one too (so far: the fleet server replaces a device's minute
        with each new total, it never adds the same minute twice)."""
        return [[s, round(self.bins[s][0], 3), round(self.bins[s][1], 3)]
                for s in sorted(self.bins)[:PER_HEARTBEAT]]  # fmt: skip

    def taken(self, sent: list[list[float]], sent_at: float) -> None:
        """The fleet server answered the heartbeat that carried ``sent`` at ``sent_at``:
        the minutes closed by then are its; one still open is sent again, with its total."""
        done = [int(s) for s, *_ in sent if s + crd.STRANDED_BIN_S <= sent_at]
        for start in done:
            self.bins.pop(start, None)
        if done:
            self._save()

    def _prune(self, now: float) -> None:
        old = [s for s in self.bins if s < now - crd.STRANDED_KEEP_S]
        for s in old:
            del self.bins[s]
        if old:
            log.warning("dropped %d minute(s) of stranded demand older than %d h that the "
                        "fleet server never took", len(old), crd.STRANDED_KEEP_S // 3600)  # fmt: skip

    def _save(self) -> None:
        write_file(self.path, json.dumps({str(k): v for k, v in sorted(self.bins.items())}))
