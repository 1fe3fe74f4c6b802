"""Heartbeat digests (fleet/digest.py) and how a fleet server replica uses them: parts
under the size of an object, times read against the reader's clock, the newest heartbeat
of a device kept, and a takeover that merges what the other replicas heard."""

from __future__ import annotations

import base64
import math
import re
import time
from typing import Any

import pytest

from hybridllm_common import crd, signing
from hybridllm_operator.edgefleet import api as api_mod
from hybridllm_operator.edgefleet import digest, endpoints
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet import server as server_mod


def _report(i: int, revision: str = "v1") -> dict[str, Any]:
    return {"revision": revision, "configVersion": 2, "healthy": True,
            "endpoint": f"https://10.0.{i // 250}.{i % 250}:8000",
            "kpis": {"tokensPerSecond": 20.0 + i % 17, "ttftP95Seconds": 0.1 + i % 7 / 100,
                     "requests": float(i % 50)}}  # fmt: skip


def _config_map(replica: str, written_at: float, seen: dict[str, Any], part: int = 0) -> dict:
    text = digest.encode(replica, written_at, seen)[part]
    return {"metadata": {"name": digest.object_name(replica, part)},
            "binaryData": {digest.KEY: text}}  # fmt: skip


def test_a_large_digest_is_cut_into_parts_each_under_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = {f"device-{i:05d}": (1000.0 + i / 10, _report(i)) for i in range(3000)}
    whole = digest.encode("fleet-a", 2000.0, seen)
    assert len(whole) == 1  # 3,000 devices: far under a ConfigMap's 1 MiB
    monkeypatch.setattr(digest, "PART_BYTES", len(whole[0]) // 3)
    parts = digest.encode("fleet-a", 2000.0, seen)
    assert len(parts) > 3
    assert all(len(p) <= digest.PART_BYTES for p in parts)
    back: dict[str, Any] = {}
    for text in parts:
        found = digest.decode({"binaryData": {digest.KEY: text}})
        assert (found.replica, found.written_at) == ("fleet-a", 2000.0)
        assert not set(back) & set(found.seen)
        back.update(found.seen)
    assert back == {k: (round(t, 3), r) for k, (t, r) in seen.items()}


def test_times_are_read_against_the_readers_clock() -> None:
    found = digest.Digest("fleet-b", 5000.0, {"d": (4990.0, {})})  # seen 10 s before writing
    assert found.dated(5000.0) == {"d": (4990.0, {})}
    # the writer's clock runs 100 s ahead: never later than the reader saw the digest
    assert found.dated(4900.0) == {"d": (4890.0, {})}
    # it runs behind: the writer's own date, so the device looks older, never newer
    assert found.dated(5003.0) == {"d": (4990.0, {})}


@pytest.mark.parametrize(
    ("obj", "problem"),
    [
        ({"binaryData": {}}, f"no binaryData.{digest.KEY}"),
        ({"binaryData": {digest.KEY: "bm90IGd6aXA="}}, "unreadable digest"),
        ({"binaryData": {digest.KEY: base64.b64encode(b"\x1f\x8b").decode()}},
         "unreadable digest"),
    ],
)  # fmt: skip
def test_a_digest_this_version_cannot_read_is_refused_by_name(obj: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        digest.decode(obj)


def test_object_names_are_dns_names_for_any_identity() -> None:
    name = digest.object_name("Host.Example_1a2b3c4d", 2)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert name.endswith("-2")
    assert digest.object_name("fleet-a") != digest.object_name("fleet-b")


def _server(identity: str) -> server_mod.FleetServer:
    srv = server_mod.FleetServer(kube_mod.Kube("shops"), identity=identity)
    for i in range(3):
        srv._on_device("ADDED", f"dev-{i}", {
            "metadata": {"name": f"dev-{i}", "labels": {}},
            "spec": {"fleet": "shops", "approved": True,
                     "publicKey": signing.public_key_text(signing.generate_key())},
            "status": {"phase": "Ready", "revision": "v1", "configVersion": 2},
        })  # fmt: skip
    return srv


def test_a_follower_keeps_digests_and_a_new_leader_takes_the_newest_heartbeat() -> None:
    srv = _server("fleet-a")
    now = time.time()
    # fleet-b heard dev-0 and dev-1; fleet-c heard dev-1 later, on v2
    srv._on_digest("ADDED", "b", _config_map("fleet-b", now, {
        "dev-0": (now - 2, _report(0)), "dev-1": (now - 3, _report(1)),
    }))  # fmt: skip
    srv._on_digest(
        "ADDED", "c", _config_map("fleet-c", now, {"dev-1": (now - 1, _report(1, "v2"))})
    )
    # its own digest (of an earlier process of the same pod) is not read
    srv._on_digest("ADDED", "a", _config_map("fleet-a", now, {"dev-2": (now, _report(2, "v9"))}))
    assert set(srv.digests) == {"b", "c"}
    assert digest.object_name("fleet-a") not in srv.digests
    assert all(not d.report for d in srv.devices.values())  # a follower merges nothing
    srv.lead(True)
    assert srv.devices["dev-0"].report["revision"] == "v1"
    assert srv.devices["dev-1"].report["revision"] == "v2"  # the newer of the two
    assert not srv.devices["dev-2"].report
    # a takeover, like a restart, counts every device not offline as seen at it
    assert all(d.last_seen is not None and d.last_seen >= now - 1 for d in srv.devices.values())
    assert srv.metrics.leader._value.get() == 1
    # while leading, a digest is merged as it arrives: an older heartbeat changes nothing
    srv._on_digest("MODIFIED", "b", _config_map("fleet-b", now + 1, {
        "dev-1": (now - 10, _report(1, "v0")),
    }))  # fmt: skip
    assert srv.devices["dev-1"].report["revision"] == "v2"
    srv._on_digest("MODIFIED", "b", _config_map("fleet-b", now + 2, {
        "dev-1": (now + 2, _report(1, "v3")),
    }))  # fmt: skip
    assert srv.devices["dev-1"].report["revision"] == "v3"
    srv.lead(False)
    assert srv.metrics.leader._value.get() == 0


def test_a_follower_takes_the_leaders_records_and_a_leader_keeps_its_own() -> None:
    srv = _server("fleet-a")
    moved = {
        "metadata": {"name": "dev-0", "labels": {}},
        "spec": {"fleet": "shops", "approved": True,
                 "publicKey": signing.public_key_text(signing.generate_key())},
        "status": {"phase": "Updating", "assignedVersion": 3, "assignedWave": 0},
    }  # fmt: skip
    srv._on_device("MODIFIED", "dev-0", moved)
    assert srv.devices["dev-0"].status["assignedVersion"] == 3
    srv.lead(True)
    echo = {**moved, "status": {"phase": "Ready", "assignedVersion": 2}}
    srv._on_device("MODIFIED", "dev-0", echo)
    assert srv.devices["dev-0"].status["assignedVersion"] == 3  # its own write is the truth


def test_a_fleet_status_patch_removes_the_revisions_no_device_runs_any_more() -> None:
    stored = {"revisions": {"v1": 2, "v2": 2}, "devices": 4, "rollout": {"wave": 0}}
    new = {"revisions": {"v2": 4}, "devices": 4, "rollout": None}
    assert server_mod._with_nulls(stored, new) == {
        "revisions": {"v1": None, "v2": 4}, "devices": 4, "rollout": None,
    }  # fmt: skip


def test_a_forged_digest_entry_is_left_out_and_planning_goes_on() -> None:
    """A digest is a ConfigMap anyone who writes ConfigMaps in the namespace can write:
    each entry passes the checks a device's own heartbeat passes, and its time must be a
    finite number (a report with a wrong type crashed the planning loop of every fleet in
    the namespace). The good entries of the same digest still count."""
    srv = _server("fleet-a")
    now = time.time()
    forged = {
        "dev-0": (now - 1, {**_report(0), "healthy": "yes"}),  # a wrong type
        "dev-1": (now - 1, {**_report(1), "endpoint": "file:///etc/passwd"}),  # no http(s) URL
        "dev-2": (now - 1, {**_report(2), "admin": True}),  # a field no device sends
    }
    cm = _config_map("fleet-b", now, forged)
    found = digest.decode(cm, api_mod.check_report)
    assert set(found.refused) == {"dev-0", "dev-1", "dev-2"}
    assert not found.seen
    srv._on_digest("ADDED", "b", _config_map("fleet-b", now, {
        **forged, "dev-0": (now - 1, _report(0, "v7")),
    }))  # fmt: skip
    srv.lead(True)
    assert srv.devices["dev-0"].report["revision"] == "v7"  # the valid entry counts
    assert not srv.devices["dev-1"].report
    assert not srv.devices["dev-2"].report
    srv._on_digest("MODIFIED", "b", _config_map("fleet-b", math.nan, {}))  # no time at all
    assert "b" in srv.digests  # the readable digest before it is kept
    srv.lead(False)


def test_an_endpoint_the_gateways_must_not_be_sent_to_is_left_out_of_a_digest() -> None:
    """A digest entry passes the endpoint rule a device's own heartbeat does
    (fleet/endpoints.py): an IP address, not loopback, link-local or the like, or inside
    the fleet's endpointNetworks where it lists them; https, unless the fleet allows
    plain HTTP."""
    srv = _server("fleet-a")
    srv._on_fleet("ADDED", "shops", {"metadata": {"name": "shops"}, "spec": {"service": "chat"}})
    now = time.time()
    srv._on_digest("ADDED", "b", _config_map("fleet-b", now, {
        "dev-0": (now - 1, {**_report(0), "endpoint": "https://169.254.169.254:80"}),
        "dev-1": (now - 1, {**_report(1), "endpoint": "http://10.0.0.1:8000"}),  # plain HTTP
        "dev-2": (now - 1, _report(2)),  # 10.0.0.2: a site's address
    }))  # fmt: skip
    srv.lead(True)
    assert not srv.devices["dev-0"].report
    assert not srv.devices["dev-1"].report
    assert srv.devices["dev-2"].report["endpoint"] == "https://10.0.0.2:8000"
    assert endpoints.problem("https://10.0.0.2:8000", ["192.168.0.0/16"]) == (
        "endpoint https://10.0.0.2:8000: 10.0.0.2 is outside the fleet's "
        "spec.enrollment.endpointNetworks (192.168.0.0/16)"
    )
    assert endpoints.problem("https://127.0.0.1:8000", ["127.0.0.0/8"]) is None  # allowed
    assert endpoints.problem("https://[::1]:8000", None) is not None
    assert "must be an IP address" in (
        endpoints.problem("https://kubernetes.default.svc", None) or ""
    )
    assert "not https" in (endpoints.problem("http://10.0.0.2:8000", None) or "")
    assert endpoints.problem("http://10.0.0.2:8000", None, plain_http=True) is None
    srv.lead(False)


def test_stranded_demand_is_checked_folded_once_summed_over_devices_and_kept_across_leaders() -> (
    None
):
    """The minutes a site gateway stranded (the cloud unreachable from its site) arrive in
    heartbeats, directly or through a follower's digest, maybe twice: each device's minute
    counts once, devices add up, a new leader starts from the status the last one wrote."""
    now = time.time()
    minute = int(now // 60 * 60) - 600
    check = api_mod.check_report
    assert check({"strandedDemand": [[minute, 100, 10.5]]})["strandedDemand"] == [
        (minute, 100.0, 10.5)
    ]
    for bad, problem in (
        ([[minute, 1]], "not \\[start"), ([[minute, True, 1]], "not \\[start"),
        ([[minute + 1, 1, 1]], "whole minute"), ([[-60, 1, 1]], "whole minute"),
        ([[minute, -1, 1]], "finite"), ([[minute, 1, 1]] * 241, "at most 240"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=problem):
            check({"strandedDemand": bad})
    srv = _server("fleet-a")
    written = [{"start": minute - 60, "promptTokens": 50.0, "completionTokens": 5.0}]
    srv._on_fleet("ADDED", "shops", {"metadata": {"name": "shops"}, "spec": {"service": "chat"},
                                     "status": {"strandedDemand": written}})  # fmt: skip
    fleet, members = srv.fleets["shops"], list(srv.devices.values())
    builder = srv.planner.status

    def beat(name: str, at: float, bins: list[list[float]]) -> None:
        d = srv.devices[name]
        d.report, d.heard_at = check({**_report(0), "strandedDemand": bins}), at

    def minutes() -> dict[int, tuple[float, float]]:
        return {b.start: (b.prompt_tokens, b.completion_tokens)
                for b in builder.stranded(fleet, members, now)}  # fmt: skip

    assert minutes() == {minute - 60: (50.0, 5.0)}  # the last leader's, as it wrote them
    beat("dev-0", now - 5, [[minute, 100, 10]])
    # a device whose clock is hours off: its heartbeat counts, minutes outside the day do not
    beat("dev-2", now - 5, [[minute - 2 * 86_400, 5, 5], [minute + 7200, 5, 5]])
    beat("dev-1", now - 4, [[minute, 30, 3], [minute + 60, 7, 1]])
    assert minutes() == {minute - 60: (50.0, 5.0), minute: (130.0, 13.0), minute + 60: (7.0, 1.0)}
    assert minutes()[minute] == (130.0, 13.0)  # the same reports again: counted once
    beat("dev-0", now - 1, [[minute, 100, 10]])  # a heartbeat repeated (its answer was lost)
    assert minutes()[minute] == (130.0, 13.0)
    fleet.status.stranded_demand = builder.stranded(fleet, members, now)  # the status written
    srv.lead(True)
    srv.lead(False)  # leadership lost: the next takeover starts from the status
    assert fleet.stranded is None
    assert minutes()[minute] == (130.0, 13.0)  # dev-0's report held then: in the status already
    assert minutes() == {minute - 60: (50.0, 5.0), minute: (130.0, 13.0), minute + 60: (7.0, 1.0)}
    assert builder.stranded(fleet, members, minute + 86_400 + 30) == [
        crd.StrandedBin(start=minute + 60, prompt_tokens=7.0, completion_tokens=1.0)
    ]  # a day on, the older minutes are gone
