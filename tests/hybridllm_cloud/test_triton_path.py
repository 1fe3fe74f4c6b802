"""The engine runs on the Triton kernels (interpreter on CPU) with the same greedy tokens.

``TRITON_INTERPRET`` must be set before triton is imported, so the Triton run happens in a
child process; it prints its tokens as JSON and they are compared with the torch backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
from pathlib import Path
from hybridllm_kernels import ops
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams
engine = llm_engine.LLMEngine.from_path(
    Path(sys.argv[1]), llm_engine.EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=6)
)
prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [5, 6, 7, 8, 9, 30]]
outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
print(json.dumps({"backend": ops.backend_name(), "tokens": [o.token_ids for o in outs]}))
"""


def run(model_dir: Path, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_triton_interpreter_matches_torch_backend(tiny_model_dir: Path) -> None:
    pytest.importorskip("triton")
    torch_run = run(tiny_model_dir, {"HYBRIDLLM_KERNELS": "torch"})
    triton_run = run(tiny_model_dir, {"HYBRIDLLM_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    assert torch_run["backend"] == "torch"
    assert triton_run["backend"] == "triton-interpret"
    assert triton_run["tokens"] == torch_run["tokens"]
