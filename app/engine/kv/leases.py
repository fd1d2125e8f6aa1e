"""Leases: the blocks a finished prefill keeps for the decoders that will pull them.

A lease id is a capability. It carries its issue time, 128 random bits and a MAC
keyed per block server from the cluster's private key, so the block server tells
at once an id it never issued, or one too old to be live, from a genuine one
whose lease has not reached it yet (the worker learns of a lease with the
engine's next step, and a fast decoder can ask before that). Only genuine fresh
ids wait; every other unknown id is answered at once, holding no thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: How long after its issue a genuine lease id not yet in the table is waited for.
#: The worker receives it with the engine's next step; an id older than this that
#: the table does not hold has ended (or expired) and is refused at once.
FRESH_S = 30.0

_ISSUED = struct.Struct("!d")
_NONCE_BYTES, _TAG_BYTES = 16, 16


class LeaseIds:
    """Issues and checks one block server's lease ids (scheduler and worker derive the same key)."""

    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def for_block_server(cls, cluster_key_pem: str, address: tuple[str, int]) -> LeaseIds:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"pdd lease ids {address[0]}:{address[1]}".encode())
        return cls(hkdf.derive(cluster_key_pem.encode()))

    def issue(self, now: float | None = None) -> str:
        body = _ISSUED.pack(time.monotonic() if now is None else now) + secrets.token_bytes(_NONCE_BYTES)
        return base64.urlsafe_b64encode(body + self._tag(body)).decode()

    def age_s(self, lease_id: str, now: float | None = None) -> float | None:
        """Seconds since a genuine id was issued; None for an id this server never issued."""
        try:
            raw = base64.urlsafe_b64decode(lease_id.encode())
        except (binascii.Error, ValueError):
            return None
        body, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if len(body) != _ISSUED.size + _NONCE_BYTES or not hmac.compare_digest(tag, self._tag(body)):
            return None
        (issued,) = _ISSUED.unpack(body[: _ISSUED.size])
        return (time.monotonic() if now is None else now) - issued

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_TAG_BYTES]


@dataclass
class Lease:
    request_id: str
    """The prefill request whose blocks these are (what vLLM frees when the lease ends)."""
    block_ids: list[int]
    consumers: int
    expires_at: float
    pulls: int = 0
    serving: int = 0
    """Pulls being sent right now: the blocks must outlive them, whatever the clock says."""


@dataclass
class LeaseTable:
    """Leases a prefill worker serves, by lease id; `done` collects the request ids of
    those to free (pulled or expired), and `ended` when each served lease ended (kept
    `FRESH_S`, so a replay of an ended id is answered at once)."""

    leases: dict[str, Lease] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    ended: dict[str, float] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, lease_id: str, block_ids: list[int], consumers: int, ttl_s: float, request_id: str | None = None) -> None:
        """`request_id`: what `take_done` reports for it (default: the lease id)."""
        request_id = lease_id if request_id is None else request_id
        with self.cond:
            if consumers <= 0:
                self.done.add(request_id)
                return
            self.leases[lease_id] = Lease(request_id, list(block_ids), consumers, time.monotonic() + ttl_s)
            self.cond.notify_all()

    def begin(self, lease_id: str, timeout_s: float) -> Lease | None:
        """The lease, marked as being served; waits at most `timeout_s` for one not yet
        here (call it only for a genuine fresh id). Every successful begin() is followed by pulled()."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while lease_id not in self.leases:
                left = deadline - time.monotonic()
                if left <= 0 or lease_id in self.ended:
                    return None
                self.cond.wait(left)
            lease = self.leases[lease_id]
            lease.serving += 1
            return lease

    def pulled(self, lease_id: str) -> None:
        with self.cond:
            lease = self.leases.get(lease_id)
            if lease is None:
                return
            lease.serving -= 1
            lease.pulls += 1
            if lease.pulls >= lease.consumers:
                self._end(lease_id)

    def expire(self, now: float | None = None) -> list[str]:
        """End the leases past their time and not being served (those go when their pull
        ends); returns their request ids."""
        now = time.monotonic() if now is None else now
        with self.cond:
            gone = [lid for lid, lease in self.leases.items() if lease.expires_at <= now and lease.serving == 0]
            return [self._end(lid) for lid in gone]

    def _end(self, lease_id: str) -> str:
        """(Holding cond.) The lease's blocks go back to vLLM; returns its request id."""
        request_id = self.leases.pop(lease_id).request_id
        self.done.add(request_id)
        self.ended[lease_id] = time.monotonic()
        self.cond.notify_all()
        return request_id

    def take_done(self) -> set[str]:
        with self.cond:
            out, self.done = self.done, set()
            forgotten = time.monotonic() - FRESH_S
            self.ended = {lid: at for lid, at in self.ended.items() if at > forgotten}
            return out

    def __len__(self) -> int:
        with self.cond:
            return len(self.leases)
