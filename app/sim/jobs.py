"""The conductor's bookkeeping: one conversation (`Session`), one request (`Job`)."""

from __future__ import annotations

from app.policy import Pipeline
from app.sim.engine import Instance, Lease, Seq
from app.sim.workload import Request


class Session:
    __slots__ = ("divs", "stream", "prefill", "main", "relay", "busy", "waiting")

    def __init__(self) -> None:
        self.divs: list[int] = []
        """Tokens kept at each context rewrite (see app/sim/cache.usable_tokens)."""
        self.stream = 0
        self.prefill: int | None = None
        self.main: int | None = None
        self.relay: int | None = None
        self.busy = False
        self.waiting: list[Request] = []


class Job:
    __slots__ = (
        "rid", "req", "sess", "gen", "pipe", "t_first", "t_last", "gap", "done",
        "p", "pl", "d", "dl", "r", "rl", "pulls", "seq", "sent", "rounds", "hmode", "cap",
        "relay_open", "relay_tokens", "t_relay_last", "handed", "wan", "t_prev", "off",
    )

    def __init__(self, rid: int, req: Request, sess: Session, gen: int):
        self.rid = rid
        self.req = req
        self.sess = sess
        self.gen = gen
        self.pipe = Pipeline.colocated
        self.t_first = -1.0
        self.t_last = -1.0
        self.gap = 0.0
        self.done = False
        self.p: Instance | None = None
        self.pl: Lease | None = None
        self.d: Instance | None = None
        """The replica that finishes the request (MD, or the PD decoder)."""
        self.dl: Lease | None = None
        self.r: Instance | None = None
        self.rl: Lease | None = None
        self.pulls = 0
        self.seq: Seq | None = None
        self.sent = 0
        self.rounds = 0
        self.hmode = None
        self.cap = 0
        self.relay_open = False
        self.relay_tokens = 0
        self.t_relay_last = -1.0
        self.handed = False
        self.wan = 0
        self.t_prev = -1.0
        """Client time of the token before the decode in progress (for its first gap)."""
        self.off = 0.0
        """One-way latency from the decoding replica to the client."""
