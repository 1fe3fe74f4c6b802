"""Ask a running service one question per tier through its gateway, with the openai SDK.

Usage: python hack/ask.py http://127.0.0.1:8080/v1 [--local]

With --local (``make up``), it ends with how to use the service and the local commands.
"""

from __future__ import annotations

import sys
import time

from openai import OpenAI

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Here are my notes from the week; summarise them in two sentences. "
    + "Monday: planned the release, fixed the login bug, reviewed two designs. " * 30,
]


def main(base_url: str, local: bool) -> int:
    client = OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id.split(":")[0]
    for question in QUESTIONS:
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
        )
        answer = raw.parse().choices[0].message.content or ""
        shown = question if len(question) < 70 else question[:67] + "..."
        print(f"\n> {shown}")
        print(
            f"[{raw.headers.get('x-hybridllm-tier')} tier, route "
            f"{raw.headers.get('x-hybridllm-route')}, {time.perf_counter() - start:.1f} s]"
        )
        print(answer.strip())
    if not local:
        return 0
    print(
        f"""
Try it yourself:

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="unused")
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)

`hybridllm status` shows the processes, `hybridllm logs` their logs, `make down` stops it."""
    )
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--local"]
    sys.exit(main(args[0] if args else "http://127.0.0.1:8080/v1", "--local" in sys.argv[1:]))
