"""`pdd run`: stops on SIGTERM as on Ctrl-C, so its cleanup runs; a failed deploy says why in a few lines."""

from __future__ import annotations

import os
import signal

import pytest

from app.cli import failure_summary, stop_on_sigterm


@pytest.fixture
def sigterm_restored():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_unwinds_like_ctrl_c(sigterm_restored):
    stop_on_sigterm()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line
        signal.pause()


RAY_FAILURE = """The deployments ['Ingress'] are UNHEALTHY.
Deployment 'Ingress' in application 'pdd' has 1 replicas that failed to start 3 times in a row. Error:
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/ray/serve/_private/replica.py", line 1139, in initialize_and_get_metadata
    await self._replica_impl.initialize(deployment_config)
  File "/venv/lib/python3.11/site-packages/ray/serve/_private/replica.py", line 712, in initialize
    raise RuntimeError(msg)

RuntimeError: Some protocols failed to start their listeners: [http] port 8000 is in use by another process
"""


def test_a_failed_deploy_is_summed_up_by_what_failed_and_why():
    summary = failure_summary(RAY_FAILURE)
    assert summary.splitlines() == [
        "The deployments ['Ingress'] are UNHEALTHY.",
        "Deployment 'Ingress' in application 'pdd' has 1 replicas that failed to start 3 times in a row. Error:",
        "RuntimeError: Some protocols failed to start their listeners: [http] port 8000 is in use by another process",
    ]
    assert failure_summary("no traceback here") == "no traceback here"
