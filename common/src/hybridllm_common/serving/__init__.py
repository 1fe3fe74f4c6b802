"""The server layer both runtimes share (``hybridllm_cloud.server``, ``hybridllm_edge.server``).

- :mod:`.settings`: the settings every runtime server has (model source, served name,
  listen address, queue bound), the base of each runtime's pydantic-settings model;
- :mod:`.app`: the FastAPI app's skeleton: its state, the error layer, ``/health``,
  ``/metrics``, ``/v1/models`` and the two completion routes;
- :mod:`.metrics`: the metric families both runtimes export, and how an answer's outputs
  are timed;
- :mod:`.requests`: the request half of serving a completion (readiness, model name,
  queue bound, prompt, sampling fields, grammars, the outputs' queue, the client's
  disconnect);
- :mod:`.responses`: the response half (OpenAI answers, SSE chunks, usage, logprobs, the
  stream that answers only after its first chunk).

Each runtime keeps what is its own: its engine calls, its settings, flags and metrics.
These modules import FastAPI, prometheus_client and pydantic-settings (the ``server``
extra, which both runtimes install); nothing else in ``hybridllm_common`` imports them.
"""
