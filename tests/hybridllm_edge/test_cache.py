"""ResponseCache alone: keys, TTL and the LRU bound, with an explicit clock."""

from __future__ import annotations

from hybridllm_edge import cache


def _answer(text: str) -> cache.CachedAnswer:
    return cache.CachedAnswer((text,), "stop", 3, 1, -0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_key_normalizes_whitespace_but_not_words_roles_or_parameters() -> None:
    body = {"temperature": 0.0, "max_tokens": 8}
    key = cache.make_key("rev", "chat", [["user", cache.normalize("  What  is\nit? ")]], body)
    assert key == cache.make_key("rev", "chat", [["user", "What is it?"]], body)
    assert key != cache.make_key("rev", "chat", [["user", "What is that?"]], body)
    assert key != cache.make_key("rev", "chat", [["system", "What is it?"]], body)
    assert key != cache.make_key("rev2", "chat", [["user", "What is it?"]], body)
    assert key != cache.make_key("rev", "completions", [["user", "What is it?"]], body)
    assert key != cache.make_key(
        "rev", "chat", [["user", "What is it?"]], {**body, "max_tokens": 9}
    )
    # one partition per tenant: another tenant's cached answer is never served
    assert key != cache.make_key(
        "rev", "chat", [["user", "What is it?"]], {**body, "cache_salt": "tenant-b"}
    )
    # an answer under one output format or tool set is never served for another (a cached
    # answer to the same prompt under another JSON schema was, before they were keyed)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    shaped = {**body, "response_format": fmt}
    assert key != cache.make_key("rev", "chat", [["user", "What is it?"]], shaped)
    other = {**fmt, "json_schema": {"name": "a", "schema": {"type": "array"}}}
    assert cache.make_key("rev", "chat", [["user", "What is it?"]], shaped) != cache.make_key(
        "rev", "chat", [["user", "What is it?"]], {**body, "response_format": other}
    )
    for field, value in (
        ("guided_regex", "a+"),
        ("tools", [{"type": "function"}]),
        ("tool_choice", "required"),
        ("structured_outputs", {"choice": ["a"]}),
    ):
        assert key != cache.make_key(
            "rev", "chat", [["user", "What is it?"]], {**body, field: value}
        )


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    c = cache.ResponseCache(ttl_seconds=10, max_entries=4, clock=clock)
    c.put("k", _answer("a"))
    clock.now = 9.9
    assert c.get("k") == _answer("a")
    clock.now = 10.0
    assert c.get("k") is None
    assert len(c) == 0


def test_least_recently_used_goes_first_past_the_bound() -> None:
    c = cache.ResponseCache(ttl_seconds=100, max_entries=2, clock=Clock())
    c.put("a", _answer("a"))
    c.put("b", _answer("b"))
    assert c.get("a") is not None  # a is now the most recent
    c.put("c", _answer("c"))
    assert c.get("b") is None
    assert c.get("a") is not None
    assert c.get("c") is not None
    assert len(c) == 2
