"""`pdd run` stops on SIGTERM as on Ctrl-C, so its cleanup runs."""

from __future__ import annotations

import os
import signal

import pytest

from app.cli import stop_on_sigterm


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
