"""`hybridllm-operator`: run the operator (the same as `hybridllm operator run`)."""

from __future__ import annotations

import sys

from hybridllm_operator import cli


def main() -> int:
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
