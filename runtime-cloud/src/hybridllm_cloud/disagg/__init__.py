"""Disaggregated serving: prefill and decode workers, and the KV transfer between them.

Flow (decode-initiated, conditional; the shape of Dynamo's and llm-d's designs):

1. The decode worker receives the OpenAI request (from the gateway) and admits it. If its
   uncached prompt part is longer than ``local_prefill_threshold`` tokens and some prefill
   worker has capacity, the scheduler allocates the prompt's blocks here (prefix hits
   included) and the connector asks a prefill worker for a remote prefill, naming the first
   block it lacks. Otherwise it prefills locally, exactly like the monolithic engine.
2. The prefill worker runs the prompt through its own engine (chunked, with its own prefix
   cache) with ``max_tokens=1``; after every layer of every step it ships the blocks that
   the step completed (and, once, its own prefix-cache hits the decode side lacks). Then it
   sends the first token, its logprobs and the request's generator state.
3. The decode worker writes the blocks into the blocks it allocated as they arrive, and,
   once all arrived, registers their prefix hashes, appends the first token and continues
   decoding with continuous batching, streaming tokens to the client.

Failures: a prefill worker that dies, times out, sends a bad checksum or says it is busy
is skipped and the transfer retried on another; when none is left the request is
prefilled locally. Blocks are never freed while a transfer may still write them.
"""
