"""`pdd run`: stops on SIGTERM as on Ctrl-C, so its cleanup runs; a failed deploy says why in a few lines."""

from __future__ import annotations

import os
import signal

import pytest

from app.ops.cli import failure_summary, stop_on_sigterm


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


#: What Serve's dashboard answered when port 8000 was taken (`pdd run`, trimmed).
RAY_FAILURE = """Request failed with status code 500: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/ray/dashboard/modules/serve/serve_head.py", line 175, in put_all_applications
    client = await serve_start_async(
             ^^^^^^^^^^^^^^^^^^^^^^^^
ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::HAProxyManager.ready()\x1b[39m (pid=9368, ip=127.0.0.2)
  File "/venv/lib/python3.11/site-packages/ray/serve/_private/haproxy.py", line 2107, in _reload_haproxy
    await self._haproxy_start_task
RuntimeError: HAProxy crashed during startup: [NOTICE]   (9404) : haproxy version is 2.8.25-5cf5d0683
[ALERT]    (9404) : Binding [haproxy.cfg:50] for frontend http_frontend: cannot bind socket (Address already in use) for [127.0.0.1:8000]
[ALERT]    (9404) : Some protocols failed to start their listeners! Exiting.
."""


def test_a_failed_deploy_is_summed_up_by_what_failed_and_why():
    assert failure_summary(RAY_FAILURE).splitlines() == [
        "Request failed with status code 500:",
        "ray.exceptions.RayTaskError(RuntimeError): ray::HAProxyManager.ready() (pid=9368, ip=127.0.0.2)",
        "RuntimeError: HAProxy crashed during startup: [NOTICE]   (9404) : haproxy version is 2.8.25-5cf5d0683",
        "[ALERT]    (9404) : Binding [haproxy.cfg:50] for frontend http_frontend: cannot bind socket (Address already in use) for [127.0.0.1:8000]",
        "[ALERT]    (9404) : Some protocols failed to start their listeners! Exiting.",
    ]
    assert failure_summary("no traceback here") == "no traceback here"
