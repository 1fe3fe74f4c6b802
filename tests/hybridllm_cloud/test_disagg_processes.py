"""A prefill and a decode process serve SmolLM2-135M together to the real ``openai`` client.

Both are ``hybridllm-cloud serve`` processes on loopback (``--role prefill`` and
``--role decode --prefill-url tcp://...``, every prompt sent for remote prefill). Their
answers must be the monolithic engine's, token for token; their metrics must show the
remote prefills and the bytes moved. Killing the prefill process makes the decode worker
fall back to local prefill with the same answers.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "A paged KV cache stores keys and values in fixed-size blocks so that",
    "List three primary colors:",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "hybridllm_cloud.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "smollm2", "--max-model-len", "512",
           "--num-kv-blocks", "256", "--torch-threads", "1", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{args} exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{args} not ready:\n{log.read_text()}")


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def pair(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("disagg")
    kv_port = _free_port()
    model = ["--model", str(real_model_dir)]
    prefill, prefill_url = _start(
        [*model, "--role", "prefill", "--kv-port", str(kv_port)], tmp / "prefill.log"
    )
    decode, decode_url = _start(
        [*model, "--role", "decode", "--prefill-url", f"tcp://127.0.0.1:{kv_port}",
         "--local-prefill-threshold", "0", "--kv-transfer-retries", "0"],
        tmp / "decode.log",
    )  # fmt: skip
    try:
        yield {"prefill": prefill, "prefill_url": prefill_url, "decode": decode, "url": decode_url}
    finally:
        for proc in (decode, prefill):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def expected(real_model_dir: Path) -> dict[str, str]:
    engine = llm_engine.LLMEngine.from_path(
        real_model_dir, llm_engine.EngineConfig(num_kv_blocks=256, max_model_len=512)
    )
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


def _ask(url: str, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    if stream:
        chunks = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return (
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )


def test_prefill_and_decode_processes_match_monolithic(
    pair: dict, expected: dict[str, str]
) -> None:
    url = pair["url"]
    for i, prompt in enumerate(PROMPTS):
        assert _ask(url, prompt, stream=bool(i % 2)) == expected[prompt]
    assert _metric(url, "hybridllm_prefills_total", where="remote", outcome="ok") == len(PROMPTS)
    assert _metric(url, "hybridllm_kv_transfer_bytes_total", direction="received") > 0
    sent = _metric(pair["prefill_url"], "hybridllm_kv_transfer_bytes_total", direction="sent")
    assert sent == _metric(url, "hybridllm_kv_transfer_bytes_total", direction="received")
    assert _metric(url, "hybridllm_engine_role_info", role="decode") == 1
    assert re.search(r"hybridllm_kv_cache_blocks_used \d", httpx.get(url + "/metrics").text)


def test_prefill_process_killed_decode_prefills_locally(
    pair: dict, expected: dict[str, str]
) -> None:
    pair["prefill"].send_signal(signal.SIGKILL)
    pair["prefill"].wait(timeout=30)
    url = pair["url"]
    before = _metric(url, "hybridllm_prefills_total", where="remote", outcome="failed")
    assert _ask(url, PROMPTS[2], stream=True) == expected[PROMPTS[2]]
    assert _metric(url, "hybridllm_prefills_total", where="remote", outcome="failed") == before + 1
    # The worker is now backing off: the next prompt goes local without trying it.
    assert _ask(url, PROMPTS[0], stream=False) == expected[PROMPTS[0]]
    assert _metric(url, "hybridllm_prefills_total", where="local", outcome="ok") >= 1
    assert httpx.get(url + "/health").status_code == 200


def test_gateway_rides_out_a_dead_decode_worker(
    real_model_dir: Path, expected: dict[str, str], tmp_path: Path
) -> None:
    """Gateway -> two decode workers -> one prefill worker; one decode worker is killed.

    Requests that were sent to the dead worker fail before their first byte (connection
    refused or reset), which is the retryable failure the gateway acts on: it retries them
    on the other decode worker and ejects the dead one, so the client sees only answers.
    """
    import json

    kv_port = _free_port()
    model = ["--model", str(real_model_dir)]
    procs = []
    try:
        prefill, _ = _start([*model, "--role", "prefill", "--kv-port", str(kv_port)],
                            tmp_path / "prefill.log")  # fmt: skip
        procs.append(prefill)
        decode_args = [*model, "--role", "decode", "--prefill-url", f"tcp://127.0.0.1:{kv_port}",
                       "--local-prefill-threshold", "0"]  # fmt: skip
        decodes = [_start(decode_args, tmp_path / f"decode-{i}.log") for i in range(2)]
        procs += [p for p, _ in decodes]
        routing = {
            "service": "demo", "namespace": "test", "model": "smollm2", "revision": "v1",
            "policy": "cloud-only",
            "edgeLimits": {"maxPromptTokens": 2048, "maxOutputTokens": 512, "maxQueueDepth": 8},
            "sessionAffinity": {"enabled": False, "header": "x-session-id"},
            "cascade": {"enabled": False, "minMeanLogprob": -1.5},
            "rateLimits": {"requestsPerMinute": 100_000, "tokensPerMinute": 100_000_000},
            "tiers": {"cloud": {"backends": [
                {"url": url, "revision": "v1", "weight": 100} for _, url in decodes]}},
        }  # fmt: skip
        config = tmp_path / "routing.json"
        config.write_text(json.dumps(routing))
        port = _free_port()
        cmd = [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config", str(config),
               "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
        gateway = subprocess.Popen(
            cmd, stdout=(tmp_path / "gateway.log").open("wb"), stderr=subprocess.STDOUT
        )
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway not healthy"
            time.sleep(0.2)
        for i, prompt in enumerate(PROMPTS):
            assert _ask(url, prompt, stream=bool(i % 2)) == expected[prompt]
        decodes[0][0].send_signal(signal.SIGKILL)
        decodes[0][0].wait(timeout=30)
        for i, prompt in enumerate(PROMPTS * 2):  # every request, whichever worker it picks
            assert _ask(url, prompt, stream=bool(i % 2)) == expected[prompt]
        assert _metric(decodes[1][1], "hybridllm_prefills_total", where="remote", outcome="ok") >= 4
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
