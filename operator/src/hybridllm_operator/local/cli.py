"""`hybridllm up`, `apply`, `down`, `status` and `logs`: an LLMService manifest on this machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridllm_common import cli as common_cli
from hybridllm_operator.local import files

if TYPE_CHECKING:
    from hybridllm_operator.local import plan as plan_mod

# `status`, `logs` and `down` import only `files`: the planner, the supervisor and what
# they import (the renderer, the autoscaler, the Kubernetes client) load for `up` and
# `apply` alone, so the light commands answer at once.

EXIT_INVALID = 2


def _root(args: argparse.Namespace) -> Path:
    return Path(args.state_root) if args.state_root else files.state_root()


def _error(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _read_state(service_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((service_dir / files.STATE_FILE).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def running_state(service_dir: Path) -> dict[str, Any] | None:
    """The state of a live supervisor in ``service_dir``, else None."""
    state = _read_state(service_dir)
    if state and files.is_alive(state.get("supervisor_pid"), state.get("supervisor_start_time")):
        return state
    return None


def service_dir(args: argparse.Namespace) -> Path:
    """The directory of the service ``args.name`` names (``--state-root`` too)."""
    return _root(args) / str(args.name)


def pick_service(args: argparse.Namespace) -> Path:
    """The service directory a command is about: NAME, or the only one with state."""
    root = _root(args)
    if args.name:
        return root / str(args.name)
    known = sorted(p.parent for p in root.glob(f"*/{files.STATE_FILE}"))
    if len(known) == 1:
        return known[0]
    if not known:
        raise LookupError(f"no local service has state under {root}; start one with `hybridllm up`")
    names = ", ".join(p.name for p in known)
    raise LookupError(f"several local services ({names}); name one")


# --------------------------------------------------------------------------- up


def _up(args: argparse.Namespace) -> int:
    import pydantic

    from hybridllm_operator.local import plan as plan_mod
    from hybridllm_operator.local import supervisor as sup
    from hybridllm_operator.observability import metrics as observed
    from hybridllm_operator.settings import OperatorSettings

    try:
        manifest = plan_mod.load_manifest(Path(args.file), args.name)
    except plan_mod.ManifestError as exc:
        return _error(str(exc), EXIT_INVALID)
    service = manifest.service()
    api_keys = Path(args.api_keys_file) if args.api_keys_file else None
    problems = plan_mod.local_problems(service, gpus=plan_mod.gpu_count(), api_keys_file=api_keys)
    if problems:
        for problem in problems:
            print(f"error: {manifest.path}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    try:  # the forecast settings the supervisor's autoscaler reads, refused now if bad
        OperatorSettings()
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = "HYBRIDLLM_OPERATOR_" + "_".join(str(x) for x in first["loc"]).upper()
        return _error(f"{field}: {first['msg']}", EXIT_INVALID)
    service_dir = _root(args) / manifest.name
    running = running_state(service_dir)
    if running:
        return _error(
            f"{manifest.name} is already running (supervisor pid {running['supervisor_pid']}, "
            f"{running['gateway_url']}); `hybridllm down {manifest.name}` first"
        )
    try:
        plan_mod.check_port_free(args.host, args.port)
        plan = plan_mod.make_plan(
            manifest, service_dir, host=args.host, gateway_port=args.port, api_keys_file=api_keys
        )
    except plan_mod.ManifestError as exc:
        return _error(str(exc), EXIT_INVALID)
    for note in plan_mod.local_notes(service):
        print(f"note: {note}")
    if args.metrics:
        try:
            with socket.socket() as probe:  # refused now, not after the replicas started
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(observed.split_address(args.metrics))
        except (ValueError, OSError) as exc:
            return _error(f"--metrics {args.metrics}: {exc}", EXIT_INVALID)
    if args.prometheus_url:
        if not args.metrics:
            return _error(
                "--prometheus-url feeds the dashboard page, which --metrics HOST:PORT serves: "
                "give both",
                EXIT_INVALID,
            )
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", args.prometheus_url):
            return _error(
                f"--prometheus-url {args.prometheus_url!r} is not an http(s) URL "
                "(e.g. http://127.0.0.1:9090)",
                EXIT_INVALID,
            )
    service_dir.mkdir(parents=True, exist_ok=True)
    (service_dir / files.PLAN_FILE).write_text(plan.to_json())
    if not args.detach:
        try:
            supervisor = sup.Supervisor(
                plan, service_dir, grace_s=args.grace_period, metrics_address=args.metrics,
                prometheus_url=args.prometheus_url,
            )  # fmt: skip
            return asyncio.run(supervisor.run())
        except sup.AlreadyRunning as exc:
            return _error(str(exc))
    return _up_detached(args, plan, service_dir)


def _up_detached(args: argparse.Namespace, plan: plan_mod.Plan, service_dir: Path) -> int:
    log_path = service_dir / files.SUPERVISOR_LOG
    with log_path.open("ab") as log:
        start = log.tell()
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridllm_operator.local",
                str(service_dir),
                "--grace-period",
                str(args.grace_period),
                *(["--metrics", args.metrics] if args.metrics else []),
                *(["--prometheus-url", args.prometheus_url] if args.prometheus_url else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.wait_timeout
    with log_path.open("rb") as follow:
        follow.seek(start)

        def echo() -> None:
            sys.stdout.write(follow.read().decode(errors="replace"))
            sys.stdout.flush()

        while True:
            echo()
            state = _read_state(service_dir)
            if state and state.get("supervisor_pid") == child.pid and state["phase"] == "ready":
                echo()
                print(f"{plan.name} runs in the background (supervisor pid {child.pid})")
                return 0
            if child.poll() is not None:
                echo()
                return _error(f"the supervisor exited ({child.returncode}); log: {log_path}")
            if time.monotonic() > deadline:
                return _error(
                    f"{plan.name} is not ready after {args.wait_timeout:.0f}s and keeps "
                    f"starting in the background: `hybridllm status {plan.name}`, "
                    f"`hybridllm logs {plan.name}`"
                )
            time.sleep(0.5)


# --------------------------------------------------------------------------- apply


def _apply(args: argparse.Namespace) -> int:
    """A changed manifest to a running service: a new model revision rolls out (the
    operator's rollout, run by the supervisor), changed runtime settings restart the
    replicas one at a time, a changed routing reloads the gateway; what shapes the
    processes themselves needs a new `up`."""
    from hybridllm_common import crd
    from hybridllm_operator.local import plan as plan_mod
    from hybridllm_operator.local import supervisor as sup

    try:
        manifest = plan_mod.load_manifest(Path(args.file), args.name)
    except plan_mod.ManifestError as exc:
        return _error(str(exc), EXIT_INVALID)
    service_dir = _root(args) / manifest.name
    running = running_state(service_dir)
    if running is None:
        return _error(f"{manifest.name} is not running; `hybridllm up -f {args.file}` starts it")
    try:
        current = crd.parse_spec(
            manifest.name, json.loads((service_dir / files.SPEC_FILE).read_text())
        )
    except (OSError, ValueError, crd.InvalidSpec) as exc:
        return _error(f"{manifest.name}: the running spec cannot be read ({exc})")
    changes = plan_mod.spec_changes(current, manifest.spec)
    refused = plan_mod.refused_changes(changes)
    if refused:
        return _error(
            f"{manifest.path}: {', '.join(refused)}: a running local service cannot take "
            "this change (it shapes the processes: pools, replica slots, the gateway, the "
            "autoscaler); it takes changes to the model, the rollout, the routing and the "
            f"runtimes' settings. `hybridllm down {manifest.name}` and `hybridllm up -f "
            f"{args.file}` for the rest",
            EXIT_INVALID,
        )
    problems = plan_mod.gpu_problems(manifest.service(), plan_mod.gpu_count())
    problems += plan_mod.device_step_problems(manifest.spec)
    if problems:
        for problem in problems:
            print(f"error: {manifest.path}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    if not changes:
        print(f"{manifest.name} unchanged")
        return 0
    sup.write_spec(service_dir, manifest.spec)
    os.kill(int(running["supervisor_pid"]), signal.SIGUSR1)
    old, new = current.model.revision, manifest.spec.model.revision
    if old != new:
        print(
            f"{manifest.name}: revision {old} -> {new} applied; `hybridllm rollout status "
            f"{manifest.name} --local` follows the rollout"
        )
        return 0
    print(f"{manifest.name}: {', '.join(changes)} applied")
    restarts = [
        c for c in changes if not c.startswith(("spec.rollout", "spec.routing", "spec.gateway."))
    ]
    if restarts:
        print(
            "note: the same revision with new runtime settings: each replica restarts in place, "
            "one at a time (`hybridllm status`); a pool of one replica leaves its tier without "
            "a replica for those seconds, and requests to it fail meanwhile. A new "
            "spec.model.revision rolls the change out beside the running replicas instead."
        )
    return 0


# --------------------------------------------------------------------------- down


def _down(args: argparse.Namespace) -> int:
    try:
        service_dir = pick_service(args)
    except LookupError as exc:
        return _error(str(exc))
    name = service_dir.name
    state = _read_state(service_dir)
    if state is None:
        return _error(f"{name} is not running (no state in {service_dir})")
    pid, start_time = int(state.get("supervisor_pid") or 0), state.get("supervisor_start_time")
    if files.is_alive(pid, start_time):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while files.is_alive(pid, start_time) and time.monotonic() < deadline:
            time.sleep(0.2)
        if files.is_alive(pid, start_time):
            print(f"{name}: the supervisor did not stop in {args.timeout:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
    # Whatever the supervisor could not stop (it was killed, say): the recorded process
    # groups, each checked against its start time so a reused pid is left alone.
    leftovers = [p for p in state["processes"] if files.is_alive(p.get("pid"), p.get("start_time"))]
    for p in leftovers:
        print(f"{name}: stopping leftover {p['name']} (pid {p['pid']})")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p["pid"], signal.SIGKILL)
    (service_dir / files.STATE_FILE).unlink(missing_ok=True)
    print(f"{name} stopped")
    return 0


# --------------------------------------------------------------------------- status


def _status(args: argparse.Namespace) -> int:
    try:
        service_dir = pick_service(args)
    except LookupError as exc:
        return _error(str(exc))
    state = _read_state(service_dir)
    if state is None:
        return _error(f"{service_dir.name} is not running")
    alive = files.is_alive(state.get("supervisor_pid"), state.get("supervisor_start_time"))
    if args.json:
        print(json.dumps({**state, "supervisor_alive": alive}, indent=2))
        return 0 if alive else 1
    phase = state["phase"] if alive else "not running (the supervisor is gone; stale state)"
    print(
        f"{state['name']}: {phase}   gateway {state['gateway_url']}/v1   from {state['manifest']}"
    )
    if state.get("rollout"):
        from hybridllm_common import crd
        from hybridllm_operator.llmservice import rollout

        ro = crd.RolloutStatus.model_validate(state["rollout"])
        serving = f"revision {ro.stable_revision}"
        if state.get("revision") != ro.stable_revision:
            serving += f" (the spec's: {state.get('revision')})"
        print(f"{serving}   rollout {rollout.summary(ro)}   (`hybridllm rollout status "
              f"{state['name']} --local`)")  # fmt: skip
    print(
        f"{'PROCESS':<20}{'STATUS':<10}{'REVISION':<10}{'PID':>8}{'PORT':>7}{'RESTARTS':>10}"
        "  LAST EXIT"
    )
    for p in state["processes"]:
        print(
            f"{p['name']:<20}{p['status']:<10}{p.get('revision') or '-':<10}{p['pid'] or '-':>8}"
            f"{p['port']:>7}{p['restarts']:>10}  {p['last_exit'] or '-'}"
        )
    return 0 if alive else 1


# --------------------------------------------------------------------------- logs


def _logs(args: argparse.Namespace) -> int:
    if args.name and args.process is None and not (_root(args) / args.name).exists():
        args.name, args.process = None, args.name  # `hybridllm logs gateway-0`
    try:
        service_dir = pick_service(args)
    except LookupError as exc:
        return _error(str(exc))
    log_dir = service_dir / files.LOG_DIR
    available = sorted(p.stem for p in log_dir.glob("*.log"))
    if args.process == "supervisor":
        paths = [service_dir / files.SUPERVISOR_LOG]
    elif args.process:
        paths = [log_dir / f"{n}.log" for n in available if n == args.process]
        paths = paths or [
            log_dir / f"{n}.log" for n in available if n.rsplit("-", 1)[0] == args.process
        ]
        if not paths:
            return _error(
                f"no log for {args.process!r}; there are: {', '.join(available) or 'none'}"
            )
    else:
        paths = [log_dir / f"{n}.log" for n in available]
    if args.follow and len(paths) != 1:
        return _error("--follow takes one process (e.g. gateway-0)")
    for path in paths:
        if len(paths) > 1:
            print(f"==> {path.stem} <==")
        lines = path.read_text(errors="replace").splitlines()
        for line in lines[-args.tail :] if args.tail else lines:
            print(line)
    if args.follow:
        with paths[0].open("rb") as f:
            f.seek(0, os.SEEK_END)
            try:
                while True:
                    chunk = f.read()
                    if chunk:
                        sys.stdout.write(chunk.decode(errors="replace"))
                        sys.stdout.flush()
                    else:
                        time.sleep(0.3)
            except KeyboardInterrupt:
                return 0
    return 0


# --------------------------------------------------------------------------- wiring


def _state_root_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-root",
        default=None,
        help=f"where local services keep state, logs and plans (default {files.state_root()})",
    )


def _manifest_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="the manifest (YAML)")
    parser.add_argument("--name", help="which LLMService, when the file has several")


def register_up(subparsers: Any) -> None:
    up = subparsers.add_parser(
        "up",
        help=common_cli.summary("up"),
        description="Validate an LLMService manifest as the API server and operator would, "
        "render the pools the operator renders, and run each replica as a supervised "
        "process on this machine behind the gateway.",
    )
    _manifest_flags(up)
    up.add_argument("-d", "--detach", action="store_true", help="run in the background")
    up.add_argument("--host", default=files.LOOPBACK, help="gateway listen address")
    up.add_argument("--port", type=int, default=files.DEFAULT_GATEWAY_PORT, help="gateway port")
    up.add_argument(
        "--api-keys-file", help="gateway API keys (the Secret of spec.gateway.apiKeysSecret)"
    )
    up.add_argument(
        "--grace-period",
        type=float,
        default=files.DEFAULT_GRACE_S,
        help="seconds a process gets to drain after SIGTERM (default %(default)s)",
    )
    up.add_argument(
        "--wait-timeout",
        type=float,
        default=900.0,
        help="--detach: seconds to wait for ready (default %(default)s; the first run "
        "converts the model)",
    )
    up.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve the autoscaler's metrics (the operator's, docs/metrics.md) on /metrics "
        "there, and the dashboard page on /, e.g. 127.0.0.1:8081 (default: not served)",
    )
    up.add_argument(
        "--prometheus-url",
        default=None,
        metavar="URL",
        help="the Prometheus the dashboard page queries; have it scrape the file_sd targets "
        "the supervisor writes to STATE_ROOT/NAME/scrape-targets.json (docs/dashboards.md)",
    )
    _state_root_flag(up)
    up.set_defaults(func=_up)


def register_apply(subparsers: Any) -> None:
    apply = subparsers.add_parser(
        "apply",
        help=common_cli.summary("apply"),
        description="Validate the manifest as `up` does and hand it to the running service's "
        "supervisor: a new spec.model.revision rolls out as spec.rollout says (canary steps "
        "analysed on the gateway's metrics, or blueGreen, or rolling); changed runtime "
        "settings (quantization, parallel, dtype, ...) restart the replicas one at a time; "
        "a changed routing reloads the gateway. Changes to pools, replica counts, the "
        "gateway or autoscaling are refused with the fields named: they need `down` and `up`.",
    )
    _manifest_flags(apply)
    _state_root_flag(apply)
    apply.set_defaults(func=_apply)


def register_down(subparsers: Any) -> None:
    down = subparsers.add_parser("down", help=common_cli.summary("down"))
    down.add_argument("name", nargs="?", help="the service (default: the only one running)")
    down.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for a clean stop"
    )
    _state_root_flag(down)
    down.set_defaults(func=_down)


def register_status(subparsers: Any) -> None:
    status = subparsers.add_parser("status", help=common_cli.summary("status"))
    status.add_argument("name", nargs="?", help="the service (default: the only one running)")
    status.add_argument("--json", action="store_true", help="the state file as JSON")
    _state_root_flag(status)
    status.set_defaults(func=_status)


def register_logs(subparsers: Any) -> None:
    logs = subparsers.add_parser("logs", help=common_cli.summary("logs"))
    logs.add_argument("name", nargs="?", help="the service (default: the only one running)")
    logs.add_argument(
        "process", nargs="?", help="edge-0, gateway, supervisor, ... (default: every process)"
    )
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--tail", type=int, default=50, help="last N lines (0: all)")
    _state_root_flag(logs)
    logs.set_defaults(func=_logs)
