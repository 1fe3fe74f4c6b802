"""Everything of the ``LLMService`` kind: its kopf wiring (``handlers``), one reconcile
(``reconcile``, ``status``), the desired children (``builders``, pure), the periodic work
(``jobs``: the autoscaler, ``autoscaling`` and ``demand``; the rollout, ``rollout`` and
``analysis``). Local mode and the simulator import the pure parts from here too.

Nothing is imported here: ``from hybridllm_operator.llmservice import builders`` loads
only what it names (the pure side must not pull in Prometheus reads or kopf).
"""
