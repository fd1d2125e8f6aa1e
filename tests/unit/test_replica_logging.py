"""Our log lines inside Serve replicas: on the real stderr, tracebacks intact."""

from __future__ import annotations

import builtins
import logging

import pytest

from app.telemetry.replica_logging import log_to_stderr


@pytest.fixture
def app_logger():
    logger = logging.getLogger("app")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    logger.handlers.clear()
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def _tuple_print(*objects, sep=" ", end="\n", file=None, flush=False):
    """What Serve's throughput mode installs as print(): it passes the objects on as one tuple."""
    return _real_print(objects, sep=sep, end=end, file=file, flush=flush)


_real_print = builtins.print


def test_warnings_and_tracebacks_reach_stderr_once(app_logger, capfd, monkeypatch):
    log_to_stderr()
    log_to_stderr()
    monkeypatch.setattr(builtins, "print", _tuple_print)
    try:
        raise ConnectionError("emulator gone")
    except ConnectionError:
        logging.getLogger("app.conductor.conductor").exception("refreshing the link emulators' view failed")
    logging.getLogger("app.conductor.relay").debug("not shown: below INFO")
    err = capfd.readouterr().err
    assert err.count("ERROR app.conductor.conductor: refreshing the link emulators' view failed") == 1
    assert "Traceback (most recent call last):\n" in err and "ConnectionError: emulator gone" in err
    assert "('" not in err, "a traceback line written as a tuple"
    assert "not shown" not in err
