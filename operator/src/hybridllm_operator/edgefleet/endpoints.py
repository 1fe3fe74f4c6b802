"""Which endpoints a device may report: the gateways send tenants' prompts there.

A device chooses its own endpoint (its heartbeat says where it serves), and the operator
puts it in the service's routing table. Left open, an enrolled device could point the
gateways at anything they can reach: the cloud metadata address, a Service inside the
cluster, the gateway itself. So an endpoint is an IP address literal (a host name could
resolve to a cluster Service), and either inside the fleet's
``spec.enrollment.endpointNetworks`` or, where those are unset, none of loopback,
link-local, unspecified or multicast. And it is ``https``: the gateways verify the
device's certificate (``hybridllm_common.device_tls``), unless the fleet's
``spec.enrollment.plainHTTPEndpoints`` allows plain HTTP (devices whose agent predates
certificates, on a site network trusted as it is).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def problem(endpoint: str, networks: list[str] | None, plain_http: bool = False) -> str | None:
    """Why ``endpoint`` (``http(s)://host:port``) is refused, or None where it is allowed."""
    parts = urlsplit(endpoint)
    if parts.scheme != "https" and not plain_http:
        return (f"endpoint {endpoint}: not https (the gateways verify a device's certificate; "
                "an agent gets one from the fleet server, or allow plain HTTP with the "
                "fleet's spec.enrollment.plainHTTPEndpoints)")  # fmt: skip
    host = parts.hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return (f"endpoint {endpoint}: the host must be an IP address (a name could resolve "
                "inside the cluster)")  # fmt: skip
    if networks:
        allowed: list[Network] = [ipaddress.ip_network(n, strict=False) for n in networks]
        if not any(address in n for n in allowed):
            return (f"endpoint {endpoint}: {address} is outside the fleet's "
                    f"spec.enrollment.endpointNetworks ({', '.join(networks)})")  # fmt: skip
        return None
    for kind, refused in (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("unspecified", address.is_unspecified),
        ("multicast", address.is_multicast),
    ):
        if refused:
            return (f"endpoint {endpoint}: {address} is a {kind} address; allow it with the "
                    "fleet's spec.enrollment.endpointNetworks")  # fmt: skip
    return None
