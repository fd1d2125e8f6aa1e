"""How much one API key and the whole replica may have in flight (429 beyond); who may call is app/api/auth.py."""

from __future__ import annotations

from collections import Counter

from fastapi.responses import StreamingResponse

from app.api.openai_requests import APIError


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
