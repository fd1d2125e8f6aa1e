"""app/telemetry/prometheus.py: the Prometheus `pdd run` starts."""

from __future__ import annotations

from app.telemetry.prometheus import PrometheusServer
from tests.integration.conftest import free_port


def test_a_fresh_start_forgets_the_last_clusters_series(tmp_path):
    # a stand-in for the last run's TSDB: its block must not survive into this run
    old_block = tmp_path / "data" / "01OLDBLOCK"
    old_block.mkdir(parents=True)
    (old_block / "meta.json").write_text("{}")
    server = PrometheusServer(port=free_port(), workdir=tmp_path)
    server.start(fresh=True)
    try:
        assert not old_block.exists()
        assert server.query("vector(1)")
    finally:
        server.stop()
    # without `fresh` (tests, a long-lived Prometheus) the storage stays
    (tmp_path / "data" / "kept").write_text("")
    server = PrometheusServer(port=free_port(), workdir=tmp_path)
    server.start()
    try:
        assert (tmp_path / "data" / "kept").exists()
    finally:
        server.stop()
