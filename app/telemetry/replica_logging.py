"""Our modules' log lines, visible from inside Serve replicas.

Serve's throughput mode (app/ops/cluster.py) sends a replica's stderr into Serve's
own logger, which buffers 1,000 records and writes them early only for an
error. A warning such as "dc-b cut off" then reaches no
file and no console while it matters, and is lost if the replica dies. The
`app` logger writes to the process's real stderr instead, which Ray keeps in
the worker's .err file (`pdd run`: /tmp/pdd-ray/session_latest/logs/worker-*.err).
"""

from __future__ import annotations

import logging
import sys
import traceback

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    def formatException(self, ei) -> str:
        # logging's own formatting goes through print(), which Serve's throughput mode replaces
        # with one that writes each traceback line as a tuple
        return "".join(traceback.format_exception(*ei)).rstrip("\n")


def log_to_stderr(level: int = logging.INFO) -> None:
    """Idempotent: every deployment's constructor calls it, and replicas may share a process."""
    logger = logging.getLogger("app")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(_Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
