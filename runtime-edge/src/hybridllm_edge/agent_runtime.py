"""The runtime an edge config runs, and starting one beside the running one.

A config is served by ``hybridllm-edge serve``, a process of its own (``runtime_command``).
``Launcher`` pulls the config's model through the model store (its sha256 checked), starts
the runtime on whichever of ``--port`` and ``--port + 1`` the running one does not hold,
asks it the config's golden prompt (``healthCheck``), and stops a runtime (SIGTERM, then
SIGKILL after 30 s). ``serving_part`` says whether a new config needs a new runtime at all.
Which runtime serves, and draining the old one after a switch, is ``agent.Agent``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hybridllm_common import signing
from hybridllm_models import errors as model_errors

log = logging.getLogger("hybridllm_edge.agent")  # the agent's log, as before the split

HEALTH_PROBE_S = 2.0  # one /health probe of a starting runtime, on loopback
# What starting a config can fail with: the model store, the process, the health check.
START_ERRORS = (
    model_errors.ModelStoreError,
    RuntimeError,
    OSError,
    httpx.HTTPError,
    ValueError,
    KeyError,
)


def serving_part(payload: dict[str, Any]) -> str:
    """What needs a new runtime when it changes (not the version, validity or timings)."""
    return signing.canonical({k: payload.get(k) for k in ("revision", "model", "runtime")}).decode()


@dataclass(frozen=True)
class Tls:
    """The device's certificate files (``hybridllm_common.device_tls``): its runtime serves
    HTTPS with them, and the agent checks its own runtime against the fleet's CA."""

    cert: Path
    key: Path
    ca: Path

    def loopback_verify(self) -> ssl.SSLContext:
        """The agent's own calls to its runtime on 127.0.0.1: the chain is checked against
        the fleet's CA; the name is not (it is this device's, on loopback)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        return context


def runtime_command(
    payload: dict[str, Any], host: str, port: int, threads: int | None, tls: Tls | None = None
) -> list[str]:
    model, runtime = payload["model"], payload.get("runtime") or {}
    args = [
        sys.executable, "-m", "hybridllm_edge.cli", "serve",
        "--model", model["uri"], "--model-sha256", model["sha256"],
        "--backend", model.get("runtime", "llamacpp"),
        "--served-model-name", model["servedName"],
        "--host", host, "--port", str(port), "--exit-on-load-error",
        "--parallel", str(runtime.get("parallel", 4)),
    ]  # fmt: skip
    if model.get("quantization"):
        args += ["--quantization", model["quantization"]]
    if model.get("contextLength"):
        args += ["--max-model-len", str(model["contextLength"])]
    cache = runtime.get("cache")
    if cache:
        args += ["--cache-ttl-seconds", str(cache["ttlSeconds"])]
        args += ["--cache-max-entries", str(cache["maxEntries"])]
    else:
        args += ["--no-cache"]
    if threads:
        args += ["--threads", str(threads)]
    if tls is not None:
        args += ["--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
    return args


@dataclass
class Runtime:
    payload: dict[str, Any]
    port: int
    process: asyncio.subprocess.Process
    log_path: Path
    url: str  # what the heartbeat reports (the advertised host)
    tls: Tls | None = None  # serving HTTPS with the device's certificate

    @property
    def local(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def client(self, timeout: float) -> httpx.AsyncClient:
        """A client of this runtime on loopback (the agent's checks and KPI reads)."""
        verify: Any = self.tls.loopback_verify() if self.tls is not None else True
        return httpx.AsyncClient(base_url=self.local, timeout=timeout, verify=verify)


@dataclass
class Launcher:
    """Starts, checks and stops the runtimes of configs, for the agent's settings."""

    state: Path  # the runtimes' logs: runtime-PORT.log
    store_root: Path  # the model store
    host: str  # what a runtime listens on
    port: int  # a runtime takes this port or the next, whichever the running one does not
    threads: int | None
    advertise_host: str  # in a runtime's URL, the endpoint the heartbeat reports
    tls: Tls | None = None  # a runtime started now serves HTTPS (set once a certificate is had)

    def pull(self, payload: dict[str, Any]) -> None:
        from hybridllm_models import store

        model = payload["model"]
        store.Store(self.store_root).pull(model["uri"], expected_sha256=model["sha256"])

    async def start(self, payload: dict[str, Any], running: Runtime | None) -> Runtime:
        """A runtime for this config beside ``running``, answering its golden prompt; else
        it is stopped."""
        ports = (self.port, self.port + 1)
        port = ports[1] if running is not None and running.port == ports[0] else ports[0]
        log_path = self.state / f"runtime-{port}.log"
        env = {**os.environ, "HYBRIDLLM_MODEL_CACHE": str(self.store_root)}
        with log_path.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *runtime_command(payload, self.host, port, self.threads, self.tls),
                stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        scheme = "https" if self.tls is not None else "http"
        runtime = Runtime(payload, port, process, log_path,
                          f"{scheme}://{self.advertise_host}:{port}", self.tls)  # fmt: skip
        try:
            await self.check(runtime, payload.get("healthCheck") or {})
        except BaseException:
            await self.stop(runtime)
            raise
        return runtime

    async def check(self, runtime: Runtime, check: dict[str, Any]) -> None:
        timeout = float(check.get("timeoutSeconds", 300))
        deadline = time.monotonic() + timeout
        async with runtime.client(timeout) as http:
            while True:
                if runtime.process.returncode is not None:
                    raise RuntimeError(f"the runtime exited with {runtime.process.returncode}: "
                                       f"{_tail(runtime.log_path)}")  # fmt: skip
                try:
                    # each probe briefly: whatever holds the port may accept and never
                    # answer (another process bound it first), and an exited runtime must
                    # be seen at once, not after the whole check's deadline
                    probe = await http.get("/health", timeout=HEALTH_PROBE_S)
                    if probe.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"not healthy after {timeout:.0f} s: {_tail(runtime.log_path)}"
                    )
                await asyncio.sleep(0.5)
            r = await http.post("/v1/chat/completions", json={
                "model": runtime.payload["model"]["servedName"],
                "messages": [{"role": "user", "content": check.get("prompt", "Say hello.")}],
                "max_tokens": int(check.get("maxTokens", 16)), "temperature": 0.0,
            })  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"golden prompt answered {r.status_code}: {r.text[:200]}")
        answer = r.json()["choices"][0]["message"]["content"] or ""
        expect = check.get("expect")
        if not answer.strip() or (expect and not re.search(expect, answer)):
            raise RuntimeError(f"golden prompt: answer {answer[:120]!r} does not match "
                               f"{expect or 'a non-empty answer'!r}")  # fmt: skip
        log.info("golden prompt passed on port %d: %r", runtime.port, answer[:80])

    async def stop(self, runtime: Runtime) -> None:
        if runtime.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                runtime.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(runtime.process.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    runtime.process.kill()
                await runtime.process.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]
