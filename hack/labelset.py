"""Builds the labelled routing set shipped as ``data/routing_labels.jsonl``.

Each row is an OpenAI request body and the tier that should answer it. The label comes
from the kind of task, not from the features the classifier sees: small chat, short
factual questions, one-sentence rewrites, translations, classification and short
summaries are ``edge`` (a 135M-class model does them acceptably); writing or fixing code,
multi-step maths and reasoning, long documents, tool use, long-form writing and long
conversations are ``cloud``. Tasks are drawn from templates with random fillers, lengths
and ``max_tokens``; some cloud tasks are phrased without any marker words and some edge
tasks mention code or ask "why", and 4% of labels are flipped, so that the set is not
separable by the rules and the held-out accuracy means something.

``python hack/labelset.py OUT [--n N] [--seed S]`` (from the repository root) rewrites the
file. A tool of this repository, not part of the shipped gateway.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

TOPICS = ["photosynthesis", "the French revolution", "black holes", "coffee", "volcanoes",
          "the stock market", "jazz", "bees", "the moon landing", "tea ceremonies", "rust on iron",
          "the Roman empire", "rainbows", "electric cars", "penguins"]  # fmt: skip
COUNTRIES = ["France", "Japan", "Kenya", "Peru", "Canada", "Norway", "India", "Egypt"]
SENTENCES = [
    "The meeting was moved to Thursday because the room was booked.",
    "I really loved the new cafe downtown, the pastries were great.",
    "Our shipment is late again and the customer is not happy.",
    "The weather tomorrow should be sunny with a light breeze.",
    "Please remember to bring your badge to the office.",
]
CODE = [
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b\n",
    "function debounce(fn, ms) {\n  let t;\n  return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); };\n}\n",
    "SELECT user_id, COUNT(*) FROM orders WHERE created_at > now() - interval '7 days' GROUP BY 1;",
    "class Cache:\n    def __init__(self):\n        self.d = {}\n    def get(self, k):\n        return self.d[k]\n",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


def _edge(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["chat", "fact", "rewrite", "translate", "sentiment", "summary", "why"])
    t, c, s = rng.choice(TOPICS), rng.choice(COUNTRIES), rng.choice(SENTENCES)
    prompt = {
        "chat": rng.choice(
            [
                "Hi! How are you today?",
                "Tell me a fun fact.",
                "Good morning!",
                f"What do you think about {t}?",
                "Thanks, that helps!",
            ]
        ),
        "fact": f"What is the capital of {c}?"
        if rng.random() < 0.5
        else f"In one sentence, what is {t}?",
        "rewrite": f"Rewrite this more politely: {s}",
        "translate": f"Translate to {rng.choice(['French', 'German', 'Spanish'])}: {s}",
        "sentiment": f"Is this positive or negative? {s}",
        "summary": f"Summarise in five words: {s} {rng.choice(SENTENCES)}",
        "why": f"Why is the sky blue? Answer briefly, and mention {t} if relevant.",
    }[kind]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a friendly, concise assistant."})
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        messages += [
            {"role": "user", "content": rng.choice(SENTENCES)},
            {"role": "assistant", "content": "Sure."},
        ]
    messages.append({"role": "user", "content": prompt})
    if rng.random() < 0.08:  # a short question about a snippet: still edge work
        messages[-1]["content"] = f"What language is this? {rng.choice(CODE)[:60]}"
    return {"messages": messages, "max_tokens": rng.choice([None, 32, 64, 128, 256])}


def _cloud(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["code", "fix", "math", "reason", "longdoc", "tools", "longform", "longchat"])
    t = rng.choice(TOPICS)
    body: dict[str, Any] = {"max_tokens": rng.choice([None, 512, 1024, 2048, 4096])}
    if kind == "code":
        prompt = rng.choice(
            [
                f"Write a Python module with tests that implements an LRU cache keyed by {t} names.",
                "Write a function that reverses a linked list in place.",
                f"Implement a SQL query that ranks {t} by popularity per month.",
                "Refactor this: def f(x): return [i for i in x if i]",
                f"Write a bash script that backs up the {t} folder nightly.",
            ]
        )
    elif kind == "fix":
        prompt = f"This code has a bug, find and fix it:\n```\n{rng.choice(CODE)}```"
    elif kind == "math":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        prompt = f"Solve step by step: a train leaves at {a} km/h and another at {b} km/h; when do they meet if 1200 km apart? Prove your answer."
    elif kind == "reason":
        prompt = rng.choice(
            [
                f"Compare three strategies for reducing the cost of {t} and justify the trade-offs.",
                f"Design an architecture for a service that tracks {t} across regions; explain why.",
                f"Give me a detailed plan, with risks, for a research project on {t}.",
                f"Think carefully: if every {t} doubled each year, what follows in ten years, and what would break first?",
            ]
        )
    elif kind == "longdoc":
        doc = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(40, 200)))
        prompt = f"Read the report below and list every decision with its owner.\n\n{doc}"
    elif kind == "tools":
        prompt = f"What's the weather where {t} is popular, and should I travel there?"
        body["tools"] = TOOLS
    elif kind == "longform":
        prompt = f"Write a {rng.choice([1500, 2000, 3000])}-word essay on the history of {t}."
        body["max_tokens"] = rng.choice([None, 2048, 4096])
    else:
        prompt = f"Continuing our discussion, bring together everything we said about {t}."
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append(
            {
                "role": "system",
                "content": "You are an expert engineer and analyst. " * rng.randint(1, 6),
            }
        )
    turns = rng.randint(7, 14) if kind == "longchat" else rng.choice([0, 0, 1, 2])
    for _ in range(turns):
        messages += [
            {"role": "user", "content": f"And what about {rng.choice(TOPICS)}?"},
            {"role": "assistant", "content": rng.choice(SENTENCES)},
        ]
    messages.append({"role": "user", "content": prompt})
    body["messages"] = messages
    return body


def build(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = "cloud" if rng.random() < 0.5 else "edge"
        request = _cloud(rng) if label == "cloud" else _edge(rng)
        request = {k: v for k, v in request.items() if v is not None}
        if rng.random() < 0.04:
            label = "edge" if label == "cloud" else "cloud"
        rows.append({"request": request, "label": label})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = build(args.n, args.seed)
    args.out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
