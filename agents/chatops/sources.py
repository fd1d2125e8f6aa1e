"""Where chat-ops reads the cluster's own view: state, journeys, recent requests.

Two implementations of one small interface:
- `HttpSource`: the ingress's read endpoints (GET /pdd/state, /pdd/requests,
  /pdd/requests/{id}), for `pdd ask` from a shell;
- `InProcessSource`: the conductor of the ingress replica that serves
  POST /pdd/chat, called directly (no HTTP hop back into itself).
Prometheus is not here: both reach it the same way (agents/chatops/tools.py).
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

import httpx

from app.config import LiveKnobs


class SourceError(RuntimeError):
    """The cluster could not be read; the message says where and why."""


def live_values(state: dict[str, Any]) -> tuple[LiveKnobs, dict[str, int]]:
    """Live knobs and live replica counts per role, from a state (GET /pdd/state)."""
    knobs = LiveKnobs.model_validate(state.get("knobs") or {})
    replicas = {role: len(info.get("replicas") or []) for role, info in (state.get("roles") or {}).items()}
    return knobs, replicas


class DataSource(Protocol):
    async def state(self) -> dict[str, Any]:
        """What GET /pdd/state returns."""

    async def journey(self, request_id: str) -> dict[str, Any] | None:
        """One request's journey; None when the journal does not hold it."""

    async def recent_requests(self, limit: int) -> list[dict[str, Any]]:
        """The newest journeys, oldest first."""


class HttpSource:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)

    async def _get(self, path: str, **params: Any) -> httpx.Response:
        try:
            resp = await self.client.get(path, params=params or None)
        except httpx.HTTPError as err:
            raise SourceError(f"GET {self.base_url}{path}: {err or type(err).__name__}") from err
        if resp.status_code in (401, 403):
            raise SourceError(f"GET {self.base_url}{path}: {resp.status_code} (pass an operator key: --api-key or PDD_API_KEY)")
        return resp

    @staticmethod
    def _json(resp: httpx.Response, path: str) -> Any:
        if resp.status_code != 200:
            raise SourceError(f"GET {path}: {resp.status_code} {resp.text.strip()[:300]}")
        return resp.json()

    async def state(self) -> dict[str, Any]:
        return self._json(await self._get("/pdd/state"), "/pdd/state")

    async def journey(self, request_id: str) -> dict[str, Any] | None:
        path = f"/pdd/requests/{quote(request_id, safe='')}"
        resp = await self._get(path)
        if resp.status_code == 404:
            return None
        return self._json(resp, path)

    async def recent_requests(self, limit: int) -> list[dict[str, Any]]:
        return self._json(await self._get("/pdd/requests", limit=limit), "/pdd/requests")["requests"]

    async def aclose(self) -> None:
        await self.client.aclose()


class InProcessSource:
    """The ingress replica's own conductor (app/conductor.Conductor) and its journal."""

    def __init__(self, conductor: Any):
        self.conductor = conductor

    async def state(self) -> dict[str, Any]:
        return await self.conductor.state()

    async def journey(self, request_id: str) -> dict[str, Any] | None:
        j = self.conductor.journal.get(request_id)
        return None if j is None else j.to_dict()

    async def recent_requests(self, limit: int) -> list[dict[str, Any]]:
        return [j.to_dict() for j in self.conductor.journal.recent(limit)]
