"""``hybridllm fleet serve|approve|revoke|token|invite|certs``: the fleet server and its chores.

- ``serve``: the device API for the EdgeFleets of one namespace (HTTPS with ``--tls-cert``
  and ``--tls-key``; plain HTTP only with ``--insecure-http``, for a loopback test).
- ``approve DEVICE`` / ``revoke DEVICE``: set ``spec.approved`` / ``spec.revoked`` of an
  EdgeDevice (``kubectl patch`` does the same).
- ``token FLEET``: make the fleet's bootstrap token Secret (expiring) and print the token.
- ``invite FLEET NAME...``: invite devices by name, a single-use expiring token each.
- ``certs --out DIR --host NAME``: a CA and a server certificate for trying it out (a
  production server takes its certificate from the cluster's issuer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import logging
import ssl
import sys
from pathlib import Path
from typing import Any

from hybridllm_common import cli as common_cli


def _serve(args: argparse.Namespace) -> int:
    from hybridllm_operator.edgefleet import kube, server

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(getattr(logging, args.log_level.upper()))  # also when the
    # `hybridllm` command configured logging first
    tls = None
    if args.tls_cert and args.tls_key:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    elif not args.insecure_http:
        print(
            "hybridllm fleet serve: give --tls-cert and --tls-key (devices reach the server "
            "over HTTPS), or --insecure-http for a loopback test",
            file=sys.stderr,
        )
        return 2
    from hybridllm_operator import leader

    try:
        timing = leader.Timing(
            args.lease_duration_seconds, args.renew_deadline_seconds, args.retry_period_seconds
        )
    except ValueError as exc:
        print(f"hybridllm fleet serve: {exc}", file=sys.stderr)
        return 2
    if not args.digest_seconds > 0 or not args.tick_seconds > 0 or not args.demand_bin_seconds > 0:
        print("hybridllm fleet serve: --digest-seconds, --tick-seconds and "
              "--demand-bin-seconds must be positive", file=sys.stderr)  # fmt: skip
        return 2
    kube.load_config()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve(
            args.namespace, args.host, args.port, tls, args.tick_seconds, lease=args.lease_name,
            timing=timing, digest_s=args.digest_seconds, demand_bin_s=args.demand_bin_seconds,
        ))  # fmt: skip
    return 0


def _patch(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    from kubernetes.client.exceptions import ApiException

    from hybridllm_operator.edgefleet import kube

    kube.load_config()
    try:
        kube.Kube(args.namespace).patch_device_spec(args.device, spec)
    except ApiException as exc:
        if exc.status == 404:
            print(f"no EdgeDevice {args.namespace}/{args.device}", file=sys.stderr)
            return 1
        raise
    print(
        f"edgedevice {args.namespace}/{args.device}: {', '.join(f'{k}={v}' for k, v in spec.items())}"
    )
    return 0


def _approve(args: argparse.Namespace) -> int:
    return _patch(args, {"approved": True})


def _revoke(args: argparse.Namespace) -> int:
    return _patch(args, {"revoked": True})


def _ttl_and_labels(
    args: argparse.Namespace, verb: str
) -> tuple[float | None, dict[str, str]] | None:
    """``--ttl`` and the ``--label`` flags, checked (None: refused, and said why)."""
    from hybridllm_operator.edgefleet import enrollment

    try:
        return enrollment.parse_ttl(args.ttl), enrollment.parse_labels(",".join(args.label))
    except enrollment.EnrollmentError as exc:
        print(f"hybridllm fleet {verb}: {exc}", file=sys.stderr)
        return None


def _fleet_or_none(fleets: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """The EdgeFleet ``args.fleet`` (None: there is none, and it was said)."""
    from kubernetes.client.exceptions import ApiException

    from hybridllm_common import crd

    try:
        obj = fleets.custom.get_namespaced_custom_object(
            crd.GROUP, crd.VERSION, args.namespace, "edgefleets", args.fleet
        )
    except ApiException as exc:
        if exc.status == 404:
            print(f"EdgeFleet {args.namespace}/{args.fleet} not found", file=sys.stderr)
            return None
        raise
    return dict(obj)


def _token(args: argparse.Namespace) -> int:
    import time

    from kubernetes.client.exceptions import ApiException

    from hybridllm_operator.edgefleet import enrollment, kube

    parsed = _ttl_and_labels(args, "token")
    if parsed is None:
        return 2
    ttl, labels = parsed
    kube.load_config()
    secret = args.secret or f"{args.fleet}-bootstrap"
    token = enrollment.BootstrapToken(
        enrollment.new_token(), None if ttl is None else time.time() + ttl, labels
    )
    try:
        kube.Kube(args.namespace).create_token(args.fleet, secret, token.secret_data())
    except ApiException as exc:
        if exc.status == 409:
            print(f"Secret {args.namespace}/{secret} exists; delete it to make a new token",
                  file=sys.stderr)  # fmt: skip
            return 1
        raise
    until = (
        "never expires" if token.expires is None else f"expires {enrollment.rfc3339(token.expires)}"
    )
    print(f"Secret {args.namespace}/{secret}: {until}", file=sys.stderr)
    print(token.value)
    return 0


def _invite(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    from hybridllm_operator.edgefleet import enrollment, kube, waves

    parsed = _ttl_and_labels(args, "invite")
    if parsed is None:
        return 2
    ttl, labels = parsed
    if ttl is None:
        print("hybridllm fleet invite: an invitation expires (--ttl 0 is for the bootstrap "
              "token only)", file=sys.stderr)  # fmt: skip
        return 2
    kube.load_config()
    fleets = kube.Kube(args.namespace)
    obj = _fleet_or_none(fleets, args)
    if obj is None:
        return 1
    selector = (obj.get("spec") or {}).get("selector")
    if not waves.matches(labels, selector):
        want = ",".join(f"{k}={v}" for k, v in (selector or {}).items())
        print(f"hybridllm fleet invite: the labels do not match the fleet's spec.selector "
              f"({want}); give them with --label", file=sys.stderr)  # fmt: skip
        return 2
    failed = 0
    for name in args.device:
        token = enrollment.new_token()
        spec = enrollment.invite_spec(args.fleet, token, ttl)
        try:
            fleets.create_device(kube.device_body(args.namespace, obj, name, labels, spec))
        except ApiException as exc:
            if exc.status != 409:
                raise
            print(f"EdgeDevice {args.namespace}/{name} exists; not invited", file=sys.stderr)
            failed += 1
            continue
        print(f"{name} {token}")
    assert spec.invite is not None
    print(f"invited to {args.namespace}/{args.fleet}, approved, labels "
          f"{enrollment.format_labels(labels) or 'none'}; each token is good for one "
          f"enrollment until {enrollment.rfc3339(spec.invite.expires)}", file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


def _start(args: argparse.Namespace) -> int:
    import time

    from hybridllm_operator.edgefleet import kube
    from hybridllm_operator.llmservice import rollout

    kube.load_config()
    fleets = kube.Kube(args.namespace)
    obj = _fleet_or_none(fleets, args)
    if obj is None:
        return 1
    fleets.annotate_fleet(args.fleet, rollout.ACTION_ANNOTATION, f"start@{time.time():.3f}")
    status = obj.get("status") or {}
    message = (status.get("rollout") or {}).get("message", "")
    print(f"start asked of {args.namespace}/{args.fleet} ({message or 'no rollout'}); "
          "`kubectl get edgefleet` shows when the fleet server has acted", file=sys.stderr)  # fmt: skip
    return 0


def write_certs(out: Path, hosts: list[str], days: int = 365) -> None:
    """A CA (ca.pem) and a server certificate for ``hosts`` (server.pem, server-key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hybridllm fleet CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (out / "ca.pem").write_bytes(ca.public_bytes(pem))
    (out / "server.pem").write_bytes(cert.public_bytes(pem))
    private = out / "server-key.pem"
    private.touch(mode=0o600)
    private.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _certs(args: argparse.Namespace) -> int:
    write_certs(Path(args.out), args.host)
    print(f"wrote {args.out}/ca.pem (give it to devices), server.pem and server-key.pem")
    return 0


def register_fleet(subparsers: Any) -> None:
    parser = subparsers.add_parser("fleet", help=common_cli.summary("fleet"))
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the device API of a namespace's EdgeFleets")
    serve.add_argument("-n", "--namespace", default="default", help="namespace of the fleets")
    serve.add_argument("--host", default="0.0.0.0", help="listen address")
    serve.add_argument("--port", type=int, default=8443, help="listen port")
    serve.add_argument("--tls-cert", help="server certificate (PEM)")
    serve.add_argument("--tls-key", help="its private key (PEM)")
    serve.add_argument("--insecure-http", action="store_true",
                       help="serve plain HTTP (a loopback test only)")  # fmt: skip
    serve.add_argument("--tick-seconds", type=float, default=1.0,
                       help="how often fleets are planned and statuses written")  # fmt: skip
    serve.add_argument("--lease-name", default="hybridllm-fleet",
                       help="the Lease (in the fleets' namespace) whose holder plans the "
                            "waves and writes the records; the replica's identity is "
                            "POD_NAME, else host and a random suffix")  # fmt: skip
    serve.add_argument("--lease-duration-seconds", type=float, default=15.0,
                       help="how long a silent leader keeps the Lease")  # fmt: skip
    serve.add_argument("--renew-deadline-seconds", type=float, default=10.0,
                       help="a leader that could not renew this long stops writing")  # fmt: skip
    serve.add_argument("--retry-period-seconds", type=float, default=2.0,
                       help="how often the leader renews and the others try")  # fmt: skip
    serve.add_argument("--digest-seconds", type=float, default=5.0,
                       help="how often a replica that does not lead hands the heartbeats "
                            "it received to the leader (a ConfigMap write, only when a "
                            "device beat to it)")  # fmt: skip
    serve.add_argument("--demand-bin-seconds", type=float, default=600.0,
                       help="the bins of each device group's demand history, which plans "
                            "the waves of a fleet with spec.rollout.window (a profile needs "
                            "a whole day of them)")  # fmt: skip
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    serve.set_defaults(func=_serve)
    for verb, func, text in (
        ("approve", _approve, "let an enrolled device fetch configs and serve"),
        ("revoke", _revoke, "refuse every call of a device from now on"),
    ):
        p = sub.add_parser(verb, help=text, description=text)
        p.add_argument("device", help="the EdgeDevice")
        p.add_argument("-n", "--namespace", default="default")
        p.set_defaults(func=func)
    start = sub.add_parser(
        "start", help="start the wave that waits for its window (spec.rollout.window) now",
        description="Start the fleet's next wave now, whatever its window says: writes the "
        "annotation hybridllm.io/rollout-action=start@TIME, which the fleet server's leader "
        "acts on at its next tick and removes.",
    )  # fmt: skip
    start.add_argument("fleet", help="the EdgeFleet")
    start.add_argument("-n", "--namespace", default="default")
    start.set_defaults(func=_start)
    token = sub.add_parser("token", help="make a fleet's bootstrap token Secret, print the token")
    token.add_argument("fleet", help="the EdgeFleet")
    token.add_argument("-n", "--namespace", default="default")
    token.add_argument("--secret", help="Secret name (default FLEET-bootstrap, the spec's default)")
    token.add_argument("--ttl", default="24h",
                       help="how long it enrolls devices: 30m, 24h, 7d; 0 for ever (default 24h)")  # fmt: skip
    token.add_argument("--label", action="append", default=[], metavar="K=V",
                       help="a label devices auto-approved with it get (repeatable)")  # fmt: skip
    token.set_defaults(func=_token)
    invite = sub.add_parser(
        "invite", help="invite devices by name: one single-use token each, printed",
        description="Make an EdgeDevice per name, approved, with the labels given, waiting "
        "for its device to enroll with the token printed beside its name (once, before it "
        "expires).",
    )  # fmt: skip
    invite.add_argument("fleet", help="the EdgeFleet")
    invite.add_argument("device", nargs="+", help="the devices' names")
    invite.add_argument("-n", "--namespace", default="default")
    invite.add_argument("--ttl", default="24h", help="how long each token is good: 30m, 24h, 7d")
    invite.add_argument("--label", action="append", default=[], metavar="K=V",
                        help="a label of the devices (repeatable)")  # fmt: skip
    invite.set_defaults(func=_invite)
    certs = sub.add_parser("certs", help="a CA and server certificate for trying the server out")
    certs.add_argument("--out", required=True, help="folder to write them to")
    certs.add_argument("--host", action="append", required=True,
                       help="name or IP devices use to reach the server (repeatable)")  # fmt: skip
    certs.set_defaults(func=_certs)
