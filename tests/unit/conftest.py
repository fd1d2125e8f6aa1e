"""Fixtures the chat-ops unit tests share."""

from __future__ import annotations

import pytest

from agents import actuate


@pytest.fixture
def actuations(monkeypatch) -> list:
    """Every actuator call anywhere in the process (recorded, then done as usual)."""
    seen: list = []
    for cls in (actuate.ServeActuator, actuate.DryRunActuator):
        for name in ("set_knobs", "scale"):
            original = getattr(cls, name)

            def record(self, *args, _name=name, _original=original, _cls=cls.__name__):
                seen.append((_cls, _name, args))
                return _original(self, *args)

            monkeypatch.setattr(cls, name, record)
    return seen
