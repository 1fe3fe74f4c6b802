"""`hybridllm rollout status|start|promote|abort|pause|resume NAME`: a rollout by hand.

Every command but ``status`` writes the ``hybridllm.io/rollout-action`` annotation on the
LLMService (``promote@<time>``, so the same command twice is two commands); the operator
acts on it at its next look and removes it. ``kubectl annotate llms NAME
hybridllm.io/rollout-action=promote`` does the same. ``status`` prints
``status.rollout``: the phase, the step and weight, and the last analysis.

With ``--local`` they steer a service of local mode (``hybridllm up``): the command goes
to the supervisor's ``rollout-action`` file (and a SIGUSR1 wakes it), and ``status``
reads its state file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_common import crd


def _api() -> Any:
    import kubernetes

    from hybridllm_operator import kubeconfig

    kubeconfig.load(in_cluster_first=False)
    return kubernetes.client.CustomObjectsApi()


def _get(api: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kubernetes.client.exceptions import ApiException

    try:
        obj: dict[str, Any] = api.get_namespaced_custom_object(
            crd.GROUP, crd.VERSION, args.namespace, "llmservices", args.name
        )
    except ApiException as exc:
        if exc.status == 404:
            raise SystemExit(f"LLMService {args.namespace}/{args.name} not found") from None
        raise
    return obj


def format_status(obj: dict[str, Any]) -> str:
    """``status.rollout`` as a person reads it."""
    from hybridllm_operator.llmservice import analysis

    status = obj.get("status") or {}
    raw = status.get("rollout")
    name = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
    if not raw:
        return f"{name}: no rollout yet (the operator has not reconciled it)"
    r = crd.RolloutStatus.model_validate(raw)
    lines = [f"{name}: {r.phase.value}"]
    lines.append(f"  stable revision: {r.stable_revision}")
    if r.canary_revision:
        lines.append(f"  canary revision: {r.canary_revision}")
    if r.canary_revision and r.phase != crd.RolloutPhase.scheduled:
        lines.append(
            f"  step:            {r.step + 1}/{r.steps}, {r.weight}% of traffic on the canary"
        )
        if r.golden:
            lines.append(f"  golden prompts:  {r.golden}")
    if r.planned_start is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r.planned_start))
        lines.append(f"  planned start:   {when}")
    if r.message:
        lines.append(f"  {r.message}")
    if r.analysis:
        lines.append("  last analysis:")
        for v in r.analysis:
            lines.append(f"    {v.result:<12} {analysis.describe(v)}")
    return "\n".join(lines)


def _run_local(args: argparse.Namespace, verb: str) -> int:
    from hybridllm_operator.local import cli as local_cli
    from hybridllm_operator.local import files

    service_dir = local_cli.service_dir(args)
    state = local_cli.running_state(service_dir)
    if state is None:
        print(f"error: {service_dir.name} is not running (see `hybridllm status`)", file=sys.stderr)
        return 1
    if verb == "status":
        obj = {
            "metadata": {"namespace": "local", "name": state["name"]},
            "status": {"rollout": state.get("rollout")},
        }
        if args.output == "json":
            print(json.dumps(state.get("rollout"), indent=2))
        else:
            print(format_status(obj))
        return 0
    files.write_action(service_dir, f"{verb}@{time.time():.3f}")
    os.kill(int(state["supervisor_pid"]), signal.SIGUSR1)
    phase = (state.get("rollout") or {}).get("phase", "unknown")
    print(
        f"{verb} asked of {state['name']} (rollout {phase}); `hybridllm rollout status "
        f"{state['name']} --local` shows when the supervisor has acted",
        file=sys.stderr,
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    verb = args.rollout_command
    if verb == "promote" and args.full:
        verb = "promote-full"
    if args.local:
        return _run_local(args, verb)
    api = _api()
    obj = _get(api, args)
    if args.rollout_command == "status":
        if args.output == "json":
            print(json.dumps((obj.get("status") or {}).get("rollout"), indent=2))
        else:
            print(format_status(obj))
        return 0
    from hybridllm_operator.llmservice import rollout

    value = f"{verb}@{time.time():.3f}"
    api.patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, args.namespace, "llmservices", args.name,
        {"metadata": {"annotations": {rollout.ACTION_ANNOTATION: value}}},
    )  # fmt: skip
    phase = ((obj.get("status") or {}).get("rollout") or {}).get("phase", "unknown")
    print(
        f"{verb} asked of {args.namespace}/{args.name} (rollout {phase}); "
        f"`hybridllm rollout status {args.name}` shows when the operator has acted",
        file=sys.stderr,
    )
    return 0


def register_rollout(subparsers: Any) -> None:
    parser = subparsers.add_parser("rollout", help=common_cli.summary("rollout"))
    sub = parser.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    helps = {
        "status": "phase, step, weight and the last analysis",
        "start": "start a scheduled rollout now, before its planned start (spec.rollout.window)",
        "promote": "end the current step now and go to the next (--full: to the end)",
        "abort": "send all traffic back to the stable revision and remove the canary",
        "pause": "hold at the current step (no analysis moves it on)",
        "resume": "go on after pause or a failed step; retry an aborted revision",
    }
    for verb, text in helps.items():
        p = sub.add_parser(verb, help=text, description=text)
        p.add_argument("name", help="the LLMService")
        p.add_argument("-n", "--namespace", default="default", help="its namespace")
        p.add_argument(
            "--local",
            action="store_true",
            help="a service of local mode (`hybridllm up`) instead of the cluster's",
        )
        p.add_argument(
            "--state-root", default=None, help="with --local: where local services keep state"
        )
        if verb == "promote":
            p.add_argument(
                "--full", action="store_true", help="skip every remaining step and analysis"
            )
        if verb == "status":
            p.add_argument("-o", "--output", choices=("text", "json"), default="text")
        p.set_defaults(func=_run)
