"""``python -m hybridllm_operator.local STATE_DIR``: the supervisor `hybridllm up -d` starts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridllm_operator.local import files, supervisor


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridllm_operator.local")
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--grace-period", type=float, default=files.DEFAULT_GRACE_S)
    parser.add_argument("--metrics", default=None)
    parser.add_argument("--prometheus-url", default=None)
    args = parser.parse_args()
    return supervisor.run_detached(
        args.state_dir, args.grace_period, args.metrics, args.prometheus_url
    )


if __name__ == "__main__":
    sys.exit(main())
