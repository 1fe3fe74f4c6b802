"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the
rejection sampler that verifies their proposals in one forward pass of the target.

The pieces and where they run (see docs/cloud-runtime.md, "Speculative decoding"):

- ``config.SpeculativeConfig``: the engine's settings, validated once at start-up.
- ``ngram.propose``: prompt lookup on the request's own tokens, on the scheduler's side
  before a step is scheduled (it needs the whole token history, which only the scheduler
  holds, and costs no model time).
- ``draft.DraftRunner``: a smaller causal LM with its own KV cache, indexed by the target's
  block tables; it proposes inside the model runner, after the step is scheduled (so the
  blocks its proposals write into are allocated) and before the target verifies.
- ``rejection_sampler``: turns the target's logits at the 1 + k positions of a request into
  the tokens emitted this step, keeping greedy output identical and sampled output
  distributed exactly as without speculation.
"""
