"""Who may call (API keys) and how much at once (admission per key and in total, 429 beyond)."""

from __future__ import annotations

import os
from collections import Counter

from fastapi import Request
from fastapi.responses import StreamingResponse

from app.api.openai_requests import APIError


class ApiKeys:
    """Bearer keys from the config plus PDD_API_KEYS (comma-separated); none: open."""

    def __init__(self, configured: list[str]):
        env = [k.strip() for k in os.environ.get("PDD_API_KEYS", "").split(",") if k.strip()]
        self.keys = frozenset(configured) | frozenset(env)

    def check(self, request: Request) -> str:
        """The caller's key ("" when auth is off); raises 401 otherwise."""
        if not self.keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if key.strip() not in self.keys:
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
        return key.strip()


class Admission:
    """Bounds on requests in flight: per key and in total (429 beyond)."""

    def __init__(self, per_key: int, total: int):
        self.per_key = per_key
        self.total = total
        self._by_key: Counter[str] = Counter()
        self._total = 0

    def enter(self, key: str, count: int = 1) -> None:
        """`count` places for `key`, all or none (429)."""
        if self._total + count > self.total:
            raise APIError(429, "Server is at capacity; retry later", type="rate_limit_error", code="server_busy")
        if self._by_key[key] + count > self.per_key:
            raise APIError(429, "Too many concurrent requests for this API key", type="rate_limit_error", code="rate_limit_exceeded")
        self._by_key[key] += count
        self._total += count

    def leave(self, key: str, count: int = 1) -> None:
        self._by_key[key] -= count
        if self._by_key[key] <= 0:
            del self._by_key[key]
        self._total -= count

    @property
    def in_flight(self) -> int:
        return self._total

    def seats(self, key: str, count: int) -> Seats:
        """`count` places for one request's choices, all or none (429)."""
        self.enter(key, count)
        return Seats(self, key, count)


class Seats:
    """One request's places in Admission, given back once whichever path ends it first:
    the stream's end, or the response ending without ever starting the stream."""

    def __init__(self, admission: Admission, key: str, count: int):
        self._admission, self._key, self._count = admission, key, count

    def release(self) -> None:
        if self._count:
            self._admission.leave(self._key, self._count)
            self._count = 0


class SeatedStream(StreamingResponse):
    """A stream that gives its request's seats back however it ends: Starlette may be
    cancelled (client gone) before it first iterates the body, whose `finally` then never runs."""

    def __init__(self, content, seats: Seats, **kwargs):
        super().__init__(content, **kwargs)
        self._seats = seats

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._seats.release()
