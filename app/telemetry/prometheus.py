"""A real Prometheus server (Debian's `prometheus` binary) for the app, tests and agents.

Ray's `ray metrics launch-prometheus` downloads Prometheus, which fails offline;
this runs the installed one against Ray's service-discovery file (every Ray
node's metrics agent, so Serve's and ours) or against static targets.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

INSTALL_HINT = "Prometheus is not installed: `sudo apt-get install prometheus` (Debian/Ubuntu), or put `prometheus` on PATH"


def binary() -> str | None:
    return shutil.which("prometheus")


def ray_service_discovery_file(ray_temp_dir: str | Path | None = None) -> Path:
    """The file Ray keeps listing each node's metrics endpoint, in the cluster's
    temp folder (`ray start --temp-dir`; Ray's default when None)."""
    return Path(ray_temp_dir or Path(tempfile.gettempdir()) / "ray") / "prom_metrics_service_discovery.json"


class PrometheusServer:
    """Start/stop one Prometheus; `query` and `rules` talk to its HTTP API."""

    def __init__(
        self,
        *,
        port: int = 9090,
        scrape_interval_s: float = 5.0,
        file_sd: Path | None = None,
        static_targets: list[str] | None = None,
        rule_files: list[Path] | None = None,
        workdir: Path | None = None,
    ):
        self.port = port
        self.scrape_interval_s = scrape_interval_s
        self.file_sd = file_sd
        self.static_targets = static_targets or []
        self.rule_files = [Path(p).resolve() for p in rule_files or []]
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pdd-prometheus-"))
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        interval = f"{self.scrape_interval_s:g}s"
        scrape: list[dict[str, Any]] = []
        if self.file_sd is not None:
            scrape.append({"job_name": "ray", "file_sd_configs": [{"files": [str(self.file_sd)]}]})
        if self.static_targets:
            scrape.append({"job_name": "static", "static_configs": [{"targets": self.static_targets}]})
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": scrape,
        }

    def start(self, timeout_s: float = 60, *, fresh: bool = False) -> PrometheusServer:
        """`fresh`: begin with empty storage. A new cluster exports the same series names
        (same app, same links) as the last one here, and within the agents' window the
        last cluster's pulls, failures and rates would be read as this one's."""
        exe = binary()
        if exe is None:
            raise RuntimeError(INSTALL_HINT)
        if fresh:
            shutil.rmtree(self.workdir / "data", ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config()))
        log = (self.workdir / "prometheus.log").open("w")
        self._proc = subprocess.Popen(
            [
                exe,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self._proc.returncode}): {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"prometheus not ready on {self.url} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; raises with Prometheus' own error text on bad PromQL."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=30)
        body = resp.json()
        if body.get("status") != "success":
            raise ValueError(f"PromQL error for {promql!r}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float = 60, interval_s: float = 1.0) -> list[dict[str, Any]]:
        """Poll until a query returns data (scrapes are periodic)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(interval_s)

    def rules(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/api/v1/rules", timeout=30).json()["data"]["groups"]

    def failing_targets(self) -> dict[str, str]:
        """Scrape targets whose last scrape failed, with Prometheus' reason (why a query is empty)."""
        active = httpx.get(f"{self.url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
        return {t["scrapeUrl"]: t.get("lastError", "") for t in active if t.get("health") != "up"}
