"""Heartbeat digests: how the replicas of the fleet server share what devices told them.

A device beats to whichever replica its connection reaches. One replica, the holder of
the Lease ``hybridllm-fleet``, leads: it plans the waves and writes every record. The
others keep the heartbeats they receive in memory and publish them every
``--digest-seconds`` in a digest: a ConfigMap of their own (labelled
``hybridllm.io/fleet-digest``), holding for each device the time of its last heartbeat
and that heartbeat, as gzip'd JSON. A replica writes its digest only when a device beat
to it since its last one or an entry aged out, so a fleet whose devices all reach the
leader costs no write, and one follower costs one write per period however many devices
it hears.

The leader watches the digests and keeps, for each device, the newest heartbeat any
replica has. Times are the writer's clock, read against the leader's own: a device was
seen ``writtenAt - seenAt`` before the digest was written, and the leader dates the
digest no later than when it saw it, so a writer's clock ahead of the leader's cannot
make a device look more recent than it is.

Ten thousand devices are about 240 KB in a digest; one larger than ``PART_BYTES`` is cut
into parts, a ConfigMap each (``NAME-1``, ``NAME-2``, ...), under the 1 MiB of an object.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import crd

LABEL = f"{crd.GROUP}/fleet-digest"
REPLICA_LABEL = f"{crd.GROUP}/fleet-replica"
KEY = "devices.json.gz"
PART_BYTES = 700 * 1024  # of base64 text; a ConfigMap holds at most 1 MiB


def object_name(identity: str, part: int = 0) -> str:
    """The digest ConfigMap of a replica (its part ``part``): a DNS name from any identity."""
    safe = re.sub(r"[^a-z0-9-]+", "-", identity.lower()).strip("-")[:200] or "replica"
    return f"hybridllm-fleet-digest-{safe}" + (f"-{part}" if part else "")


def label_value(identity: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", identity)[:63].strip("-_.") or "replica"


@dataclass
class Digest:
    """One digest object as read: whose it is, when it was written (writer's clock), and
    for each device when it was seen (writer's clock) and what it reported."""

    replica: str
    written_at: float
    seen: dict[str, tuple[float, dict[str, Any]]]
    refused: dict[str, str] = field(default_factory=dict)  # device -> why its entry was left out

    def dated(self, observed_at: float) -> dict[str, tuple[float, dict[str, Any]]]:
        """The entries with their times on the reader's clock, for a digest the reader
        saw at ``observed_at``: never later than that, however far ahead the writer's
        clock runs."""
        base = min(observed_at, self.written_at)
        return {
            name: (base - (self.written_at - seen_at), report)
            for name, (seen_at, report) in self.seen.items()
        }


def encode(
    replica: str, written_at: float, seen: dict[str, tuple[float, dict[str, Any]]]
) -> list[str]:
    """The base64 texts of the parts of a digest (one, unless it is large)."""
    names = sorted(seen)
    parts = 1
    while True:
        size = -(-len(names) // parts) if names else 0
        chunks = [names[i : i + size] for i in range(0, len(names), size)] if names else [[]]
        texts = [_text(replica, written_at, {n: seen[n] for n in chunk}) for chunk in chunks]
        if all(len(t) <= PART_BYTES for t in texts) or size <= 1:
            return texts
        parts = len(chunks) * 2


def _text(replica: str, written_at: float, seen: dict[str, tuple[float, dict[str, Any]]]) -> str:
    body = {
        "replica": replica,
        "writtenAt": round(written_at, 3),
        "devices": {name: [round(t, 3), report] for name, (t, report) in seen.items()},
    }
    raw = json.dumps(body, separators=(",", ":")).encode()
    return base64.b64encode(gzip.compress(raw, 6)).decode()


MAX_DIGEST_BYTES = 64 << 20  # of a part, unzipped: ten thousand devices are ~240 KB


def decode(
    obj: dict[str, Any], check: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> Digest:
    """A digest from its ConfigMap (as the API server's JSON); ValueError when it is not
    one this version can read. Anyone who may write ConfigMaps in the namespace can write
    one, so nothing in it is trusted: times must be finite numbers, and each report passes
    ``check`` (the checks a device's own heartbeat passes); an entry that does not is left
    out, with the reason in ``Digest.refused``."""
    text = (obj.get("binaryData") or {}).get(KEY)
    if not text:
        raise ValueError(f"no binaryData.{KEY}")
    try:
        raw = gzip.GzipFile(fileobj=io.BytesIO(base64.b64decode(text))).read(MAX_DIGEST_BYTES + 1)
        if len(raw) > MAX_DIGEST_BYTES:
            raise ValueError(f"over {MAX_DIGEST_BYTES} bytes unzipped")
        body = json.loads(raw)
        written_at = _finite(body["writtenAt"])
        seen: dict[str, tuple[float, dict[str, Any]]] = {}
        refused: dict[str, str] = {}
        for name, entry in body["devices"].items():
            try:
                if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], dict):
                    raise ValueError("not [time, report]")
                report = check(entry[1]) if check is not None else dict(entry[1])
                seen[str(name)] = (_finite(entry[0]), report)
            except ValueError as exc:
                refused[str(name)[:253]] = str(exc)[:200]
        return Digest(str(body["replica"]), written_at, seen, refused)
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"unreadable digest: {exc}") from exc


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"time {value!r} is not a finite number")
    return float(value)
