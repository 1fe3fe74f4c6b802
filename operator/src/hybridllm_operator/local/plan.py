"""From a manifest to the processes local mode runs: the operator's renderer, placed on loopback.

The pools, their programs and every flag come from :func:`hybridllm_operator.llmservice.builders.pools`,
the function the operator renders Deployments from. Local mode changes only the flags in
:data:`builders.ADDRESS_FLAGS` (where a process listens and finds its peers) and runs
each replica of a pool as its own process on its own loopback port, where the cluster
runs pods behind a Service. The gateway's routing table is the operator's too
(:func:`builders.routing_config`), with one backend per ready replica instead of one
Service URL per tier.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from hybridllm_common import crd
from hybridllm_operator.llmservice import builders
from hybridllm_operator.local.files import DEFAULT_GATEWAY_PORT, LOOPBACK

NAMESPACE = "local"  # what the routing table and metrics call the namespace locally


class ManifestError(Exception):
    """The manifest cannot be run; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    name: str
    spec: crd.LLMServiceSpec

    def service(self) -> builders.Service:
        return builders.Service(name=self.name, namespace=NAMESPACE, uid="local", spec=self.spec)


def load_manifest(path: Path, name: str | None = None) -> Manifest:
    """The LLMService in ``path``, checked as the API server and the operator check it.

    The schema errors are the pydantic models' the CRD is generated from, with the field
    path; the rules no schema expresses are :func:`crd.semantic_errors`, which the
    operator reports as ``Degraded``. Either way nothing starts.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"{path}: {exc.strerror or exc}") from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from exc
    services = [d for d in docs if isinstance(d, dict) and d.get("kind") == "LLMService"]
    if name is not None:
        services = [d for d in services if (d.get("metadata") or {}).get("name") == name]
    if not services:
        which = f" named {name!r}" if name else ""
        raise ManifestError(f"{path}: no LLMService{which} in the file")
    if len(services) > 1:
        names = ", ".join(str((d.get("metadata") or {}).get("name")) for d in services)
        raise ManifestError(f"{path}: {len(services)} LLMServices ({names}); pick one with --name")
    doc = services[0]
    if doc.get("apiVersion") != crd.API_VERSION:
        raise ManifestError(
            f"{path}: apiVersion: {doc.get('apiVersion')!r}, expected {crd.API_VERSION!r}"
        )
    svc_name = (doc.get("metadata") or {}).get("name")
    if not isinstance(svc_name, str) or not svc_name:
        raise ManifestError(f"{path}: metadata.name: Required value")
    raw_spec = doc.get("spec")
    if not isinstance(raw_spec, dict):
        raise ManifestError(f'{path}: LLMService "{svc_name}" is invalid: spec: Required value')
    try:
        spec = crd.parse_spec(svc_name, raw_spec)
    except crd.InvalidSpec as exc:
        raise ManifestError(f'{path}: LLMService "{svc_name}" is invalid: {exc}') from exc
    return Manifest(path=path, name=svc_name, spec=spec)


def gpu_count() -> int:
    """NVIDIA GPUs the driver reports (one directory per GPU), without loading CUDA."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def local_problems(
    service: builders.Service, *, gpus: int, api_keys_file: Path | None
) -> list[str]:
    """Why this machine cannot run the spec locally, naming the field; empty when it can."""
    problems = gpu_problems(service, gpus) + device_step_problems(service.spec)
    if service.spec.gateway.api_keys_secret and api_keys_file is None:
        problems.append(
            "spec.gateway.apiKeysSecret: local mode has no Secrets; pass the key file with "
            "--api-keys-file (lines of NAME:SHA256, see `hybridllm gateway hash-key`)"
        )
    return problems


def device_step_problems(spec: crd.LLMServiceSpec) -> list[str]:
    """Rollout steps that would wait for an EdgeFleet: no device is enrolled locally."""
    return [
        f"spec.rollout.steps[{i}].devices: local mode enrolls no edge devices, so this step "
        "would wait for a fleet forever; leave devices out to run the manifest here"
        for i, step in enumerate(spec.rollout.steps)
        if step.devices
    ]


def gpu_problems(service: builders.Service, gpus: int) -> list[str]:
    """The pools that ask for more GPUs per replica than this machine has."""
    problems = []
    for pool in builders.pools(service):
        if pool.resources.gpu > gpus:
            problems.append(
                f"{_pool_field(service, pool.component)}.resources.gpu: a {pool.component} "
                f"replica asks for {pool.resources.gpu} GPU(s) and this machine has {gpus}; "
                "set gpu: 0 and cloud.dtype: float32 to run the cloud tier on the CPU"
            )
    return problems


def local_scaled_pools(spec: crd.LLMServiceSpec) -> dict[str, crd.PoolSpec]:
    """The pools the local supervisor's autoscaler sizes: the edge and monolithic pools
    when the mode scales (not prefill and decode: each decode process is started with the
    addresses of its prefill replicas)."""
    if spec.autoscaling.mode not in crd.SCALING_MODES and (
        spec.autoscaling.mode != crd.AutoscalingMode.advisory
    ):
        return {}
    return {c: p for c, p in crd.scaled_pools(spec).items() if c in ("edge", "monolithic")}


def core_bound(component: str, need: int, held: int, cores: int) -> str:
    """Why one more replica of ``component`` (``need`` threads) cannot start on a machine
    of ``cores`` cores whose running replicas hold ``held`` threads ("" when it fits):
    started anyway, it would slow every replica down instead of adding capacity."""
    if held + need <= cores:
        return ""
    return (
        f"this machine has {cores} cores and its running replicas hold {held} threads; one "
        f"more {component} replica needs {need} (resources.cpu)"
    )


def local_notes(service: builders.Service) -> list[str]:
    """Fields that have no effect on one machine, said once at start-up."""
    spec = service.spec
    notes = []
    if spec.gateway.replicas > 1:
        notes.append(
            f"spec.gateway.replicas is {spec.gateway.replicas}: local mode runs one gateway"
        )
    if any(p.node_selector for p in builders.pools(service)):
        notes.append("nodeSelector: every replica runs on this machine")
    if spec.model.cache is not None:
        notes.append(
            "spec.model.cache: the claim is a cluster volume; local processes use this "
            "machine's model store (HYBRIDLLM_MODEL_CACHE), verified by sha256 the same way"
        )
    if spec.autoscaling.mode == crd.AutoscalingMode.external:
        notes.append(
            "spec.autoscaling.mode is external: there is no HPA here; every pool keeps its "
            "spec replicas"
        )
    fixed = sorted(set(crd.scaled_pools(spec)) - set(local_scaled_pools(spec)))
    if spec.autoscaling.mode in crd.SCALING_MODES and fixed:
        notes.append(
            f"autoscaling: the {' and '.join(fixed)} pools keep their spec replicas here "
            "(a decode replica is told its prefill replicas when it starts)"
        )
    zero = [c for c, p in local_scaled_pools(spec).items() if p.min_replicas == 0]
    if zero:
        notes.append(
            f"minReplicas 0 ({', '.join(zero)}): local mode keeps one replica (its gateway "
            "routes to running processes only, so nothing would wake a stopped pool)"
        )
    if spec.rollout.strategy == crd.RolloutStrategy.rolling:
        notes.append(
            "spec.rollout.strategy is rolling: a new revision restarts each replica in "
            "place, one at a time (there is no surge replica locally)"
        )
    if spec.edge.enabled and spec.edge.devices is not None:
        notes.append("spec.edge.devices: devices outside this machine are not enrolled locally")
    notes.append(
        "resources: cpu sets each replica's threads (as in a pod), and the autoscaler "
        "starts no replica the machine has no free cores for (capacity-bound); memory and "
        "images are not enforced locally"
    )
    return notes


# What `hybridllm apply` may change in a running service: what the runtimes are started
# with (each replica restarts on it, or a new revision's canary runs it) and what the
# routing table says (the gateway reloads it). The rest shapes the processes themselves
# (pools, replica slots, the gateway's command, the autoscaler) and needs a new `up`.
APPLIED_FIELDS = (
    "spec.model", "spec.rollout", "spec.routing",
    "spec.gateway.requestsPerMinute", "spec.gateway.tokensPerMinute",
    "spec.edge.runtime", "spec.edge.quantization", "spec.edge.parallel",
    "spec.edge.responseCache", "spec.edge.pool.resources", "spec.edge.pool.image",
    "spec.cloud.dtype", "spec.cloud.quantization", "spec.cloud.maxNumSeqs", "spec.cloud.kvCache",
    "spec.cloud.localPrefillThreshold",
    *(f"spec.cloud.{pool}.{field}" for pool in ("monolithic", "prefill", "decode")
      for field in ("resources", "image")),
)  # fmt: skip


def spec_changes(old: crd.LLMServiceSpec, new: crd.LLMServiceSpec) -> list[str]:
    """The fields that differ, as the manifest spells them (``spec.model.revision``)."""

    def walk(a: Any, b: Any, path: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [
                c for k in sorted(set(a) | set(b)) for c in walk(a.get(k), b.get(k), f"{path}.{k}")
            ]
        return [] if a == b else [path]

    return walk(old.to_wire(), new.to_wire(), "spec")


def refused_changes(changes: list[str]) -> list[str]:
    """The changes a running local service cannot take (see :data:`APPLIED_FIELDS`)."""
    return [c for c in changes if not any(c == f or c.startswith(f + ".") for f in APPLIED_FIELDS)]


def _pool_field(service: builders.Service, component: str) -> str:
    return {
        "edge": "spec.edge.pool",
        "monolithic": "spec.cloud.monolithic",
        "prefill": "spec.cloud.prefill",
        "decode": "spec.cloud.decode",
        "gateway": "spec.gateway",
    }[component]


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Replica:
    """One local process: a replica of a pool."""

    component: str
    index: int
    command: list[str]  # program, then the rendered args with local addresses
    port: int
    kv_port: int | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    standby: bool = False  # a slot the autoscaler may start (not started at first)
    revision: str = ""  # the model revision it serves ("" for the gateway)
    track: str | None = None  # "canary": a rollout's new revision, beside the stable pools

    @property
    def name(self) -> str:
        if self.track:
            return f"{self.component}-{self.track}-{self.index}"
        return f"{self.component}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the supervisor needs, written to ``plan.json`` so a detached supervisor
    runs exactly what ``up`` checked."""

    name: str
    manifest: str
    spec: dict[str, Any]  # the checked spec, in its wire form
    replicas: list[Replica]
    routing_path: str
    gateway_url: str

    def service(self) -> builders.Service:
        spec = crd.LLMServiceSpec.model_validate(self.spec)
        return builders.Service(name=self.name, namespace=NAMESPACE, uid="local", spec=spec)

    def pool(self, component: str) -> list[Replica]:
        return [r for r in self.replicas if r.component == component]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["replicas"] = [Replica(**r) for r in data["replicas"]]
        data.pop("tiers", None)  # written by earlier versions; the supervisor derives them
        return cls(**data)


def localize(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the value of each flag in ``values`` replaced (or appended).

    Only address flags may change: the test of local mode compares everything else with
    what the operator renders into the pod.
    """
    unknown = set(values) - set(builders.ADDRESS_FLAGS)
    if unknown:
        raise ValueError(f"not address flags: {sorted(unknown)}")
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(args):
        if args[i] in values:
            out += [args[i], values[args[i]]]
            seen.add(args[i])
            i += 2
        else:
            out.append(args[i])
            i += 1
    for flag in builders.ADDRESS_FLAGS:
        if flag in values and flag not in seen:
            out += [flag, values[flag]]
    return out


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports the kernel says are free now."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(sock.getsockname()[1])
        return ports


def check_port_free(host: str, port: int) -> None:
    """Refuses a port something listens on. SO_REUSEADDR as the gateway sets it, so the
    connections of a service just stopped (TIME_WAIT) do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ManifestError(
                    f"port {port} on {host} is in use (another `hybridllm up`? see "
                    "`hybridllm status`); pass --port"
                ) from exc
            raise ManifestError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def program_path(program: str) -> str:
    """The console script beside this interpreter (the same environment), else on PATH."""
    beside = Path(sys.executable).parent / program
    if beside.exists():
        return str(beside)
    found = shutil.which(program)
    if found is None:
        raise ManifestError(
            f"{program} is not installed in this environment; install its distribution "
            f"({program}) or run from the workspace (`uv sync --all-packages`)"
        )
    return found


def place(
    pool: builders.Pool,
    index: int,
    port: int,
    *,
    kv_port: int | None = None,
    prefill_kv: Sequence[int] = (),
    standby: bool = False,
) -> Replica:
    """Replica ``index`` of a rendered runtime pool as a local process: the pool's program
    and args, with this machine's addresses (``prefill_kv``: the KV ports of the prefill
    replicas a decode replica pulls from)."""
    values = {"--host": LOOPBACK, "--port": str(port)}
    if pool.component == "prefill":
        if kv_port is None:
            raise ValueError("a prefill replica needs a KV port")
        values["--kv-port"] = str(kv_port)
    if pool.component == "decode":
        values["--prefill-url"] = ",".join(f"tcp://{LOOPBACK}:{p}" for p in prefill_kv)
    return Replica(
        pool.component, index, [program_path(pool.program), *localize(pool.args, values)],
        port=port, kv_port=kv_port, env=dict(pool.env), standby=standby,
        revision=pool.revision or "", track=pool.track,
    )  # fmt: skip


def make_plan(
    manifest: Manifest,
    state_dir: Path,
    *,
    host: str = LOOPBACK,
    gateway_port: int = DEFAULT_GATEWAY_PORT,
    api_keys_file: Path | None = None,
    ports: Iterator[int] | None = None,
) -> Plan:
    """Every replica of every pool the operator would render, placed on this machine."""
    service = manifest.service()
    pools = builders.pools(service)
    runtime_pools = [p for p in pools if p.component != "gateway"]
    # Pools start at their spec replicas; a pool the autoscaler sizes gets a slot (a port
    # and a command line) for each replica up to its maximum, the rest on standby.
    scaled = local_scaled_pools(service.spec)
    count = {c: p.replicas for c, p in crd.scaled_pools(service.spec).items()}
    slots = {c: max(count[c], p.max_replicas) if c in scaled else count[c]
             for c, p in crd.scaled_pools(service.spec).items()}  # fmt: skip
    needed = sum(slots[p.component] for p in runtime_pools) + sum(
        slots[p.component] for p in runtime_pools if p.component == "prefill"
    )
    port_iter = ports if ports is not None else iter(free_ports(needed))
    routing_path = state_dir / "routing.json"
    replicas: list[Replica] = []
    prefill_kv = [next(port_iter) for p in runtime_pools if p.component == "prefill"
                  for _ in range(count["prefill"])]  # fmt: skip
    for pool in pools:
        if pool.component == "gateway":
            values = {"--host": host, "--port": str(gateway_port), "--config": str(routing_path)}
            if api_keys_file is not None:
                values["--api-keys-file"] = str(api_keys_file)
            args = localize(pool.args, values)
            command = [program_path(pool.program), *args]
            replicas.append(Replica("gateway", 0, command, port=gateway_port, env=dict(pool.env)))
            continue
        for index in range(slots[pool.component]):
            kv_port = prefill_kv[index] if pool.component == "prefill" else None
            replicas.append(
                place(
                    pool, index, next(port_iter), kv_port=kv_port, prefill_kv=prefill_kv,
                    standby=index >= count[pool.component],
                )
            )  # fmt: skip
    shown_host = LOOPBACK if host in ("0.0.0.0", "::") else host
    return Plan(
        name=manifest.name,
        manifest=str(manifest.path),
        spec=manifest.spec.to_wire(),
        replicas=replicas,
        routing_path=str(routing_path),
        gateway_url=f"http://{shown_host}:{gateway_port}",
    )
