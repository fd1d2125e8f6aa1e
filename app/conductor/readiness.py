"""Readiness: which roles have a live engine, and whether the app can serve a request.

`GET /health` says the ingress answers (liveness). `GET /ready` says more: an app
whose engines are still starting answers every request with 503 `no_replica`,
and a load balancer or `pdd run` should wait for it. Three states:
- `ready`: every role the mode uses has a live engine;
- `degraded`: some are missing, but a request still finds a way through (with no
  prefill, the main decoder computes the whole request; with no relay decoder,
  P-MD or the prefill relays);
- `unavailable`: no request can be served: the only state `/ready` answers 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import httpx

from app.config import MODE_ROLES, Mode, RoleName

State = Literal["ready", "degraded", "unavailable"]


def fallback_decoder(configured: dict[RoleName, int]) -> RoleName:
    """The role that computes a whole request when prefill cannot (the conductor's failover)."""
    return RoleName.main_decode if configured.get(RoleName.main_decode, 0) > 0 else RoleName.relay_decode


def readiness(mode: Mode, configured: dict[RoleName, int], live: dict[RoleName, int]) -> dict[str, Any]:
    """What GET /ready answers, from the replicas each role is configured with and has live."""
    missing = [role for role in MODE_ROLES[mode] if live.get(role, 0) < 1]
    if not missing:
        state: State = "ready"
    elif live.get(fallback_decoder(configured), 0) > 0:
        state = "degraded"
    else:
        state = "unavailable"
    return {
        "status": state,
        "missing": [role.value for role in missing],
        "roles": {role.value: {"live": live.get(role, 0), "configured": n} for role, n in configured.items()},
    }


def describe(body: dict[str, Any]) -> str:
    """`prefill 1/1, relay_decode 0/1, main_decode 1/1`: live of configured, per role."""
    return ", ".join(f"{role} {r['live']}/{r['configured']}" for role, r in body["roles"].items())


def await_ready(url: str, model: str, headers: dict[str, str], timeout_s: float, echo: Callable[[str], None], poll_s: float = 1.0) -> bool:
    """Print one line starting `ready:` once every role has a live engine and a one-token
    completion through the API succeeded; after `timeout_s`, what cannot serve yet.
    Returns whether the app became ready."""
    deadline = time.monotonic() + timeout_s
    why = "the app did not answer GET /ready"
    while True:
        try:
            resp = httpx.get(f"{url}/ready", headers=headers, timeout=10)
            body = resp.json()
            why = f"{describe(body)} live ({body['status']})"
            if body["status"] == "ready":
                started = time.monotonic()
                done = httpx.post(
                    f"{url}/v1/completions", headers=headers, timeout=120, json={"model": model, "prompt": "ready", "max_tokens": 1, "temperature": 0}
                )
                if done.status_code == 200:
                    echo(f"ready: {describe(body)} engines live; a first completion took {(time.monotonic() - started) * 1000:.0f} ms")
                    return True
                why = f"every role is live, but a test completion got HTTP {done.status_code}: {done.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            why = f"the app did not answer GET /ready: {exc!r}"
        if time.monotonic() + poll_s > deadline:
            echo(f"not ready after {timeout_s:.0f} s: {why}")
            return False
        time.sleep(poll_s)
