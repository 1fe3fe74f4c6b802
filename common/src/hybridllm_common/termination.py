"""How a runtime that cannot load its model ends, when asked to (``--exit-on-load-error``).

In a pod, a process that cannot serve should exit: the pod's status then says so, and the
reason written to the container's termination message (``/dev/termination-log``, where
Kubernetes mounts it) reaches the LLMService's status through the operator. Without the
flag, a runtime stays up with ``/health`` answering 503 and the reason, which suits a
terminal or local mode, where a restart loop would only hide the message.

It also holds how long a replica that is asked to stop takes to drain (below).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

TERMINATION_LOG = Path(os.environ.get("HYBRIDLLM_TERMINATION_LOG", "/dev/termination-log"))
EXIT_CODE = 3  # the code uvicorn uses for a failed startup


def exit_for(reason: str, log: logging.Logger) -> NoReturn:
    """Log the reason, leave it as the termination message (one line), and exit now."""
    line = " ".join(reason.split())
    log.error("cannot serve, exiting (--exit-on-load-error): %s", line)
    if TERMINATION_LOG.parent.is_dir():
        try:
            TERMINATION_LOG.write_text(line[:4000] + "\n")
        except OSError as exc:  # not in a pod, or a read-only path: the log line says it
            log.debug("no termination message written to %s: %s", TERMINATION_LOG, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)  # from inside the server's startup: no shutdown to run


# How a replica leaves: Kubernetes runs its preStop hook (a sleep of DRAIN_DELAY_SECONDS,
# while the endpoint controllers and kube-proxy stop sending it new connections), then
# sends SIGTERM; the servers stop accepting, finish the requests in flight and exit.
# No request outlives MAX_REQUEST_SECONDS (the gateway's request timeout), so a
# termination grace period of the two plus a margin lets every one of them finish.
DRAIN_DELAY_SECONDS = 10
MAX_REQUEST_SECONDS = 600
TERMINATION_GRACE_SECONDS = DRAIN_DELAY_SECONDS + MAX_REQUEST_SECONDS + 5
