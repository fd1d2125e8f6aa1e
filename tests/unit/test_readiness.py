"""GET /ready's states, and `pdd run`'s ready line (app/conductor/readiness.py), against a real HTTP server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.conductor.readiness import await_ready, readiness
from app.config import Mode, RoleName

P, RLD, MD = RoleName.prefill, RoleName.relay_decode, RoleName.main_decode
ALL = {P: 1, RLD: 1, MD: 1}


def test_every_role_live_is_ready():
    body = readiness(Mode.pdd, ALL, ALL)
    assert body == {"status": "ready", "missing": [], "roles": {r.value: {"live": 1, "configured": 1} for r in ALL}}


@pytest.mark.parametrize(
    ("mode", "live", "status", "missing"),
    [
        (Mode.pdd, {P: 1, MD: 1}, "degraded", ["relay_decode"]),  # P-MD, or prefill relays
        (Mode.pdd, {RLD: 1, MD: 1}, "degraded", ["prefill"]),  # MD computes whole requests
        (Mode.pdd, {P: 1, RLD: 1}, "unavailable", ["main_decode"]),  # every pdd request ends at MD
        (Mode.pd_cross_dc_naive, {P: 1}, "unavailable", ["main_decode"]),
        (Mode.colocated, {P: 1, RLD: 1}, "unavailable", ["main_decode"]),
        (Mode.pdd, {}, "unavailable", ["prefill", "relay_decode", "main_decode"]),  # engines still starting
    ],
)
def test_missing_roles_degrade_until_no_request_could_be_served(mode, live, status, missing):
    body = readiness(mode, ALL, live)
    assert (body["status"], body["missing"]) == (status, missing)


def test_without_a_main_decoder_the_relay_decoder_is_the_fallback():
    configured = {P: 1, RLD: 1}
    assert readiness(Mode.pd_intra_dc, configured, {RLD: 1})["status"] == "degraded"
    assert readiness(Mode.pd_intra_dc, configured, {P: 1})["status"] == "unavailable"


class _App:
    """A real HTTP server answering /ready as given and failing the first `failing` completions."""

    def __init__(self, ready: dict, failing: int):
        self.ready, self.failing, self.completions = ready, failing, 0
        app = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(503 if app.ready["status"] == "unavailable" else 200, app.ready)

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                app.completions += 1
                if app.completions <= app.failing:
                    self._send(503, {"error": {"message": "no live main_decode replica", "code": "no_replica"}})
                else:
                    self._send(200, {"choices": [{"text": "x"}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_ready_line_comes_only_after_a_completion_succeeds():
    app = _App(readiness(Mode.pdd, ALL, ALL), failing=2)
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(f"{line} (after {app.completions} completions)")

    try:
        assert await_ready(app.url, "pdd-dev", {}, timeout_s=30, echo=echo, poll_s=0.05)
    finally:
        app.close()
    assert len(lines) == 1 and lines[0].startswith("ready: prefill 1/1, relay_decode 1/1, main_decode 1/1 engines live")
    assert lines[0].endswith("(after 3 completions)")


def test_after_its_timeout_it_says_which_roles_have_no_live_engine():
    app = _App(readiness(Mode.pdd, ALL, {P: 1, MD: 1}), failing=0)
    lines: list[str] = []
    try:
        assert not await_ready(app.url, "pdd-dev", {}, timeout_s=0.3, echo=lines.append, poll_s=0.05)
    finally:
        app.close()
    assert lines == ["not ready after 0 s: prefill 1/1, relay_decode 0/1, main_decode 1/1 live (degraded)"]
    assert app.completions == 0  # only a ready app is sent a completion
