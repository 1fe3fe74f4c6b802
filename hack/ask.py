"""Ask a running service one question per tier through its gateway, with the openai SDK.

Usage: python hack/ask.py http://127.0.0.1:8080/v1 [--local]

With --local (``make up``), it ends with how to use the service and the local commands.
"""

from __future__ import annotations

import sys
import time

from openai import OpenAI

# The shop's notes a support assistant answers from: a long system prompt (about 290
# tokens with the question), beyond the example's edgeLimits.maxPromptTokens (256), so
# the cloud tier answers it; the short question alone goes to the edge.
NOTES = """You answer customers of the Northwind shop from these notes.

Opening hours: the shop is open Monday to Saturday, 9 am to 6 pm, and closed on Sundays \
and public holidays.
Delivery: orders placed before 2 pm leave the warehouse the same day. Delivery takes two \
to three working days in the country and five to seven working days elsewhere in Europe. \
We do not ship outside Europe.
Returns: you can return any product within 30 days of delivery for a full refund, as \
long as it is unused and in its original packaging. Print the return label from your \
account page.
Payment: we accept credit cards, debit cards and bank transfers. We do not accept cash \
on delivery.
Warranty: every product has a two-year warranty. If a product breaks, write to support \
with your order number and a photo.
Gift cards: gift cards are valid for one year and can be used online or in the shop.
Contact: write to support@northwind.example or call 0800 123 456 during opening hours.
Shipping costs: delivery is free for orders over 50 euros; below that it costs 4.90 \
euros in the country and 9.90 euros elsewhere in Europe."""

QUESTIONS = [
    ("", "What is the capital of France? Answer in one sentence."),
    (NOTES, "Do you ship outside Europe?"),
]
# A 135M-parameter model left to greedy decoding repeats itself until max_tokens runs
# out; a frequency penalty and a stop at the first blank line keep its answers answers.
SAMPLING = {"temperature": 0, "frequency_penalty": 0.5, "stop": ["\n\n"], "max_tokens": 64}


def main(base_url: str, local: bool) -> int:
    client = OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id.split(":")[0]
    print(
        "sampling: temperature 0, frequency_penalty 0.5, stop at a blank line, "
        "max_tokens 64 (what keeps a small model from repeating itself)"
    )
    for system, question in QUESTIONS:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            **SAMPLING,  # type: ignore[arg-type]
        )
        answer = raw.parse().choices[0].message.content or ""
        shown = f"[the shop's notes, {len(system.split())} words] " if system else ""
        print(f"\n> {shown}{question}")
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
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}],
      frequency_penalty=0.5, stop=["\\n\\n"])  # a small model repeats itself without
  print(reply.choices[0].message.content)

`hybridllm status` shows the processes, `hybridllm logs` their logs, `make down` stops it."""
    )
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--local"]
    sys.exit(main(args[0] if args else "http://127.0.0.1:8080/v1", "--local" in sys.argv[1:]))
