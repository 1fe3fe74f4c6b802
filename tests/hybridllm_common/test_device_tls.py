"""A device's TLS certificate from its fleet's key (``hybridllm_common.device_tls``), and a
runtime serving over TLS that takes a renewed certificate without a restart."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridllm_common import device_tls, http_errors, signing

NAME = "dev-1.shops.stores.devices.hybridllm.internal"


def test_a_fleet_issues_certificates_a_device_and_a_gateway_can_check() -> None:
    fleet_key, device_key, other = (signing.generate_key() for _ in range(3))
    ca = device_tls.ca_certificate(fleet_key, "shops", "stores")
    # every replica and restart of the fleet server makes the same CA from the same key
    assert ca == device_tls.ca_certificate(fleet_key, "shops", "stores")
    assert ca != device_tls.ca_certificate(fleet_key, "kiosks", "stores")
    now = time.time()
    cert = device_tls.issue(fleet_key, "shops", "stores", "dev-1", device_key.public_key(), now)
    assert device_tls.server_name("dev-1", "shops", "stores") == NAME
    device_tls.check_issued(cert, ca, device_key.public_key(), fleet_key.public_key(), now)
    for key, fleet, at, why in (
        (other, fleet_key, now, "another key"),  # not this device's key
        (device_key, other, now, "pinned at enrollment"),  # a CA that is not the fleet's
        (device_key, fleet_key, now + 31 * 86400, "not valid now"),  # expired
    ):
        with pytest.raises(device_tls.CertificateError, match=why):
            device_tls.check_issued(cert, ca, key.public_key(), fleet.public_key(), at)
    forged_ca = device_tls.ca_certificate(other, "shops", "stores")  # same names, other key
    with pytest.raises(device_tls.CertificateError):
        device_tls.check_issued(cert, forged_ca, device_key.public_key(), other.public_key(), now)
    # renewal: none, unreadable, or a third of its 30 days left
    assert device_tls.needs_renewal(None, now)
    assert device_tls.needs_renewal("not a certificate", now)
    assert not device_tls.needs_renewal(cert, now + 19 * 86400)
    assert device_tls.needs_renewal(cert, now + 21 * 86400)


def _serial_served(port: int, ca: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        context = device_tls.client_context(ca)
        with context.wrap_socket(raw, server_hostname=NAME) as tls:
            der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_a_serving_runtime_takes_a_renewed_certificate_without_a_restart(tmp_path: Path) -> None:
    """The reload thread of ``http_errors.run_server``: a renewed certificate file (written
    the agent's way, a rename) is what new connections get; an unreadable one is not."""
    fleet_key, device_key = signing.generate_key(), signing.generate_key()
    ca = device_tls.ca_certificate(fleet_key, "shops", "stores")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    key.write_text(device_tls.private_key_pem(device_key))

    def write(text: str) -> None:
        tmp = tmp_path / "tls.tmp"
        tmp.write_text(text)
        os.replace(tmp, cert)

    def issued() -> str:
        return device_tls.issue(fleet_key, "shops", "stores", "dev-1", device_key.public_key(),
                                time.time())  # fmt: skip

    from cryptography import x509

    first = issued()
    write(first)
    context = device_tls.server_context(str(cert), str(key))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: the test is over
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    class Steps:
        """The reload loop's stop event: each wait does the next step, then it stops."""

        def __init__(self, *steps: Callable[[], None]) -> None:
            self.steps = list(steps)

        def wait(self, _interval: float) -> bool:
            if not self.steps:
                return True
            self.steps.pop(0)()
            return False

    try:
        serial = lambda pem: x509.load_pem_x509_certificate(pem.encode()).serial_number  # noqa: E731
        assert _serial_served(port, ca) == serial(first)
        # a broken renewal: the old certificate goes on serving
        http_errors._reload_certificate(context, str(cert), str(key), 0, Steps(lambda: write("x")))
        assert _serial_served(port, ca) == serial(first)
        renewed = issued()
        http_errors._reload_certificate(context, str(cert), str(key), 0,
                                        Steps(lambda: write(renewed)))  # fmt: skip
        assert _serial_served(port, ca) == serial(renewed)
    finally:
        stop.set()
        listener.close()
        server.join(timeout=5)
