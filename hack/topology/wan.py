"""A WAN between a site and the cloud, on this machine, in user space.

This kernel has no ``netem``; Toxiproxy (built from the Go module proxy by
``hack/testenv/build-toxiproxy.sh``, cached) relays each link's TCP connections through a
proxy that adds latency and jitter each way, caps the bandwidth, and cuts the link: a
*blackhole* (connections open but nothing gets through, as when an uplink drops: the
sender only learns it from its own timeouts) or a *refusal* (nothing listens: a site whose
router answers with resets). Everything listens on loopback; nothing on the host changes.

``Wan`` starts one ``toxiproxy-server`` (its API on a free loopback port) and makes links:
``link(name, upstream)`` returns the ``host:port`` that reaches ``upstream`` across the WAN.
``shape`` sets a link's round-trip time, jitter and bandwidth; ``cut`` and ``restore`` take
it down and up; ``bytes`` reads what crossed it (Toxiproxy's own counters). The defaults
are the issue's site: 60 ms RTT with 10 ms jitter and 100 Mbit/s.

``python hack/topology/wan.py serve --link NAME=LISTEN=UPSTREAM ...`` runs one by hand,
printing its API URL; ``cut``, ``restore`` and ``shape`` act on a running one by its URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "testenv" / "build-toxiproxy.sh"

RTT_MS, JITTER_MS, BANDWIDTH_MBIT = 60.0, 10.0, 100.0


class WanError(RuntimeError):
    pass


def build() -> Path:
    """The cached toxiproxy-server binary (built on first use)."""
    out = subprocess.run([str(BUILD)], stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode != 0:
        raise WanError(f"{BUILD} failed with exit code {out.returncode}; its log is above")
    return Path(out.stdout.strip()) / "bin" / "toxiproxy-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Api:
    """Toxiproxy's HTTP API at ``url``."""

    url: str

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as exc:
            raise WanError(f"toxiproxy {method} {path}: {exc.code} {exc.read().decode()}") from None
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    def toxic(self, link: str, name: str, kind: str, stream: str, **attributes: int) -> None:
        path = f"/proxies/{link}/toxics"
        existing = {t["name"] for t in self.call("GET", path)}
        body = {"name": name, "type": kind, "stream": stream, "toxicity": 1.0,
                "attributes": attributes}  # fmt: skip
        if name in existing:
            self.call("POST", f"{path}/{name}", body)
        else:
            self.call("POST", path, body)

    def untoxic(self, link: str, name: str) -> None:
        try:
            self.call("DELETE", f"/proxies/{link}/toxics/{name}")
        except WanError as exc:
            if "404" not in str(exc):
                raise

    def shape(self, link: str, rtt_ms: float = RTT_MS, jitter_ms: float = JITTER_MS,
              bandwidth_mbit: float | None = BANDWIDTH_MBIT) -> None:  # fmt: skip
        """Half the round trip (and of the jitter) each way; the bandwidth each way."""
        for stream in ("upstream", "downstream"):
            self.toxic(link, f"latency-{stream}", "latency", stream,  # whole milliseconds
                       latency=round(rtt_ms / 2), jitter=round(jitter_ms / 2))  # fmt: skip
            if bandwidth_mbit is None:
                self.untoxic(link, f"bandwidth-{stream}")
            else:  # Toxiproxy's rate is KB/s
                self.toxic(link, f"bandwidth-{stream}", "bandwidth", stream,
                           rate=round(bandwidth_mbit * 1000 / 8))  # fmt: skip

    def cut(self, link: str, mode: str = "blackhole") -> None:
        """``blackhole``: every byte each way is dropped (connections stay open);
        ``refuse``: the link stops listening and its connections are closed."""
        if mode == "blackhole":
            for stream in ("upstream", "downstream"):
                self.toxic(link, f"cut-{stream}", "timeout", stream, timeout=0)
        elif mode == "refuse":
            self.call("POST", f"/proxies/{link}", {"enabled": False})
        else:
            raise WanError(f"cut mode {mode!r}: blackhole or refuse")

    def restore(self, link: str) -> None:
        for stream in ("upstream", "downstream"):
            self.untoxic(link, f"cut-{stream}")
        self.call("POST", f"/proxies/{link}", {"enabled": True})

    def bytes(self, link: str) -> int:
        """Bytes that crossed the link so far, both ways (Toxiproxy's proxy metrics)."""
        text = self.call("GET", "/metrics")
        total = 0
        for line in str(text).splitlines():
            if line.startswith("toxiproxy_proxy_sent_bytes_total{") and f'proxy="{link}"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
        return total


class Wan:
    """One toxiproxy-server for the links of a topology; stopped with ``close``."""

    def __init__(self, log: Path) -> None:
        binary = build()
        port = free_port()
        self.api = Api(f"http://127.0.0.1:{port}")
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [str(binary), "-host", "127.0.0.1", "-port", str(port), "-proxy-metrics"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                self.api.call("GET", "/version")
                break
            except (OSError, WanError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise WanError(f"toxiproxy-server did not start; see {log}") from None
                time.sleep(0.05)

    def link(self, name: str, upstream: str, listen: str | None = None, *,
             shaped: bool = True) -> str:  # fmt: skip
        """A link to ``upstream`` (``host:port``) across the WAN; the address that reaches it."""
        listen = listen or f"127.0.0.1:{free_port()}"
        self.api.call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream,
                                           "enabled": True})  # fmt: skip
        if shaped:
            self.api.shape(name)
        return listen

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> Wan:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True)
    serve = sub.add_parser("serve", help="run a WAN with the given links until interrupted")
    serve.add_argument("--link", action="append", default=[], metavar="NAME=LISTEN=UPSTREAM",
                       help="a link, e.g. cloud=127.0.0.1:9000=127.0.0.1:8000 (repeatable)")  # fmt: skip
    serve.add_argument("--log", default="toxiproxy.log")
    for verb in ("cut", "restore", "shape"):
        p = sub.add_parser(verb)
        p.add_argument("api", help="the WAN's API URL (printed by serve)")
        p.add_argument("link")
        if verb == "cut":
            p.add_argument("--mode", choices=("blackhole", "refuse"), default="blackhole")
        if verb == "shape":
            p.add_argument("--rtt-ms", type=float, default=RTT_MS)
            p.add_argument("--jitter-ms", type=float, default=JITTER_MS)
            p.add_argument("--bandwidth-mbit", type=float, default=BANDWIDTH_MBIT)
    args = parser.parse_args(argv)
    if args.action == "serve":
        links = []
        for text in args.link:
            m = re.fullmatch(r"([a-z0-9-]+)=([^=]+:\d+)=([^=]+:\d+)", text)
            if not m:
                parser.error(f"--link {text!r}: NAME=HOST:PORT=HOST:PORT")
            links.append(m.groups())
        with Wan(Path(args.log)) as wan:
            for name, listen, upstream in links:
                wan.link(name, upstream, listen)
            print(wan.api.url, flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                wan.proc.wait()
        return 0
    api = Api(args.api.rstrip("/"))
    if args.action == "cut":
        api.cut(args.link, args.mode)
    elif args.action == "restore":
        api.restore(args.link)
    else:
        api.shape(args.link, args.rtt_ms, args.jitter_ms, args.bandwidth_mbit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
