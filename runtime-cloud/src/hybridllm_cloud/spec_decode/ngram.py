"""N-gram (prompt-lookup) proposals: continue the text the way it went last time.

For the last ``n`` tokens of a request (prompt + output), for ``n`` from ``max_n`` down to
``min_n``, find the most recent *earlier* occurrence of those ``n`` tokens and propose the
up to ``k`` tokens that followed it (vLLM's ``ngram`` method, HF transformers'
``prompt_lookup_num_tokens``). Agents and code edits repeat their inputs (file contents,
tool output, identifiers), which is where such guesses are right; a wrong guess costs only
the verification of its tokens in the step that checks it.

The search is vectorised with numpy: for each ``n`` one comparison of every window of the
history against the suffix, so a 16k-token history costs well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: Sequence[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """The proposal for ``tokens`` (at most ``k`` ids; empty when nothing matches).

    Longer n-grams are tried first (a longer match is a better predictor); among the
    occurrences of one n-gram the most recent wins (closest context). An occurrence must
    be followed by at least one token, so the suffix never matches itself.
    """
    if k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    total = arr.shape[0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        if n < 1:
            break
        suffix = arr[total - n :]
        # windows starting at 0 .. total-n-1: each is followed by at least one token
        windows = sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + k]]
    return []
