"""Calibration measures a real vLLM engine and the fitted model orders step shapes as the engine does."""

from __future__ import annotations

import pytest

from app.config import RoleName
from app.config.file import load_config
from app.sim.calibrate import calibrate

pytestmark = pytest.mark.integration


def test_calibration_on_a_real_engine():
    config = load_config("serve_configs/local.yaml")
    perf, samples = calibrate(
        config, RoleName.prefill, prefill_tokens=(64, 2048), prefix_shapes=((2048, 64),), decode_shapes=((1, 256), (8, 1024)), decode_tokens=16, repeats=3
    )
    by_shape = {(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read): s.step_ms for s in samples}
    # one sample per shape (the fastest of its runs)
    assert sorted(by_shape) == sorted((s.prefill_tokens, s.decode_seqs, s.kv_tokens_read) for s in samples)
    assert set(by_shape) == {(64, 0, 64), (2048, 0, 2048), (64, 0, 2048 + 64), (0, 1, 256 + 8), (0, 8, 8 * (1024 + 8))}
    assert all(s.step_ms > 0 for s in samples)
    assert [s.prefix_chunks for s in samples] == [0, 0, 1, 0, 0]  # only the shape after a cached prefix attends to one
    assert by_shape[(2048, 0, 2048)] > by_shape[(64, 0, 64)], by_shape  # 32x the tokens is never faster on one engine
    # the cached prefix is really reused: its 64 new tokens cost far less than computing all 2112
    assert by_shape[(64, 0, 2048 + 64)] < by_shape[(2048, 0, 2048)] / 2, by_shape
    # the fit reproduces what it was fitted on to within its noise
    for s in samples:
        assert perf.step_s(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read, s.attention_pairs, s.prefix_chunks) * 1000 == pytest.approx(
            s.step_ms, rel=0.6, abs=5.0
        )
