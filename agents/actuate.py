"""Actuation through Ray Serve itself: two operations, and a dry-run variant.

- Live knobs: redeploy the application config with the Conductor
  deployment's `user_config` changed. Serve sees that only `user_config`
  differs and calls the replicas' `reconfigure` (no restart). The Serve REST
  API (`PUT /api/serve/applications/`) is declarative and replaces every
  application, so the body carries every application's `deployed_app_config`
  as Serve reports it, with only ours changed; an application deployed
  imperatively (`serve.run`) has no such config, and the redeploy is refused
  rather than deleting it.
- Replica counts: `POST /api/v1/applications/{app}/deployments/{dep}/scale`
  (the application needs `external_scaler_enabled: true`). A later redeploy
  keeps the scaled count.

Auth: Ray 2.60 clusters use token auth (`RAY_AUTH_MODE=token`). Requests
carry the same `Authorization: Bearer <token>` header Ray's own dashboard SDK
(ServeSubmissionClient) sends, from the same loader (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); with auth off no header is sent.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Protocol

import httpx

from agents.figures import deployment
from app.config import LiveKnobs, RoleName
from app.ray_private import dashboard_auth_headers

#: The ingress deployment's name (app/api/ingress.py, `@serve.deployment(name="Conductor")`).
CONDUCTOR = "Conductor"
APPLICATIONS = "/api/serve/applications/"


class ActuationError(RuntimeError):
    """Serve refused or did not confirm a change; the message says which and why."""


class Actuator(Protocol):
    def current_knobs(self) -> LiveKnobs: ...

    def current_replicas(self) -> dict[str, int]: ...

    def set_knobs(self, knobs: LiveKnobs) -> None: ...

    def scale(self, role: RoleName, replicas: int) -> None: ...


class ServeActuator:
    """The real cluster, through the Ray dashboard's Serve REST API."""

    def __init__(self, dashboard_url: str, app_name: str, roles: list[RoleName], *, headers: dict[str, str] | None = None, confirm_timeout_s: float = 60.0):
        self.url = dashboard_url.rstrip("/")
        self.app_name = app_name
        self.roles = roles
        self.headers = dashboard_auth_headers() if headers is None else headers
        self.confirm_timeout_s = confirm_timeout_s
        self.http = httpx.Client(timeout=30, headers=self.headers)

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            resp = self.http.request(method, self.url + path, **kwargs)
        except httpx.HTTPError as err:
            raise ActuationError(f"{method} {self.url}{path}: {err}") from err
        if resp.status_code in (401, 403):
            raise ActuationError(
                f"{method} {path}: {resp.status_code} {resp.text.strip()} (token auth: set RAY_AUTH_MODE=token and make the cluster's token readable)"
            )
        if resp.status_code != 200:
            raise ActuationError(f"{method} {path}: {resp.status_code} {resp.text.strip()[:500]}")
        return resp

    def details(self) -> dict[str, Any]:
        return self._request("GET", APPLICATIONS).json()

    def _app(self, details: dict[str, Any]) -> dict[str, Any]:
        app = (details.get("applications") or {}).get(self.app_name)
        if app is None:
            raise ActuationError(f"Serve has no application '{self.app_name}' (have: {', '.join(details.get('applications') or {}) or 'none'})")
        return app

    def current_knobs(self) -> LiveKnobs:
        app = self._app(self.details())
        conductor = (app.get("deployments") or {}).get(CONDUCTOR)
        if conductor is None:
            raise ActuationError(f"application '{self.app_name}' has no {CONDUCTOR} deployment")
        return LiveKnobs.model_validate(conductor["deployment_config"].get("user_config") or {})

    def current_replicas(self) -> dict[str, int]:
        deployments = self._app(self.details()).get("deployments") or {}
        out = {}
        for role in self.roles:
            d = deployments.get(deployment(role))
            if d is not None:
                out[role.value] = int(d.get("target_num_replicas") or d["deployment_config"]["num_replicas"])
        return out

    def deploy_body(self, details: dict[str, Any], knobs: LiveKnobs) -> dict[str, Any]:
        """The PUT body: every application as deployed, ours with the new user_config."""
        apps = []
        for name, app in (details.get("applications") or {}).items():
            cfg = app.get("deployed_app_config")
            if cfg is None:
                raise ActuationError(f"application '{name}' was deployed imperatively (serve.run): a declarative redeploy would delete it")
            cfg = copy.deepcopy(cfg)
            if name == self.app_name:
                deps = cfg.setdefault("deployments", [])
                entry = next((d for d in deps if d.get("name") == CONDUCTOR), None)
                if entry is None:
                    entry = {"name": CONDUCTOR}
                    deps.append(entry)
                entry["user_config"] = knobs.model_dump(mode="json")
            apps.append(cfg)
        body: dict[str, Any] = {"applications": apps}
        for key in ("proxy_location", "http_options", "grpc_options", "target_capacity"):
            if details.get(key) is not None:
                body[key] = details[key]
        return body

    def set_knobs(self, knobs: LiveKnobs) -> None:
        details = self.details()
        self._app(details)
        self._request("PUT", APPLICATIONS, json=self.deploy_body(details, knobs))
        want = knobs.model_dump(mode="json")

        def reconfigured(app: dict[str, Any]) -> bool:
            # the new user_config shows up together with status UPDATING; HEALTHY again means every replica ran reconfigure
            conductor = (app.get("deployments") or {}).get(CONDUCTOR, {})
            return app.get("status") == "RUNNING" and conductor.get("status") == "HEALTHY" and conductor.get("deployment_config", {}).get("user_config") == want

        self._confirm(reconfigured, "the Conductor's user_config")

    def scale(self, role: RoleName, replicas: int) -> None:
        name = deployment(role)
        self._request("POST", f"/api/v1/applications/{self.app_name}/deployments/{name}/scale", json={"target_num_replicas": replicas})
        self._confirm(
            lambda app: (app.get("deployments") or {}).get(name, {}).get("target_num_replicas") == replicas, f"{name}'s target of {replicas} replicas"
        )

    def _confirm(self, done, what: str) -> None:
        deadline = time.monotonic() + self.confirm_timeout_s
        while True:
            app = self._app(self.details())
            if done(app):
                return
            if app.get("status") == "DEPLOY_FAILED" or time.monotonic() > deadline:
                raise ActuationError(f"Serve did not apply {what}: status {app.get('status')} {app.get('message') or ''}".strip())
            time.sleep(0.5)


class DryRunActuator:
    """Records what it would do; reads from `reader` (the real cluster) when given.

    Observe mode and the digital twin use it: the graph runs unchanged and
    nothing outside this object moves.
    """

    def __init__(self, knobs: LiveKnobs, replicas: dict[str, int], reader: Actuator | None = None):
        self.knobs = knobs
        self.replicas = dict(replicas)
        self.reader = reader
        self.calls: list[tuple[str, Any]] = []

    def current_knobs(self) -> LiveKnobs:
        return self.reader.current_knobs() if self.reader is not None else self.knobs

    def current_replicas(self) -> dict[str, int]:
        return self.reader.current_replicas() if self.reader is not None else dict(self.replicas)

    def set_knobs(self, knobs: LiveKnobs) -> None:
        self.calls.append(("set_knobs", knobs.model_dump(mode="json")))
        self.knobs = knobs

    def scale(self, role: RoleName, replicas: int) -> None:
        self.calls.append(("scale", (role.value, replicas)))
        self.replicas[role.value] = replicas
