"""The conductor's bookkeeping: one conversation (`Session`), one request (`Job`)."""

from __future__ import annotations

from app.policy import Pipeline, RelayMachine
from app.sim.engine import Instance
from app.sim.pending import Warm
from app.sim.routing import Conversation, KeyChain
from app.sim.work import Lease, Seq
from app.sim.workload import Request


class Session:
    __slots__ = ("divs", "stream", "conv", "busy", "waiting")

    def __init__(self) -> None:
        self.divs: list[int] = []
        """Tokens kept at each context rewrite (see app/sim/cache.usable_tokens)."""
        self.stream = 0
        self.conv = Conversation()
        """The conversation's block keys, as the conductor's index sees them."""
        self.busy = False
        self.waiting: list[Request] = []


class Job:
    __slots__ = (
        "rid",
        "req",
        "sess",
        "gen",
        "pipe",
        "keys",
        "full",
        "t_first",
        "t_last",
        "gap",
        "done",
        "p",
        "pl",
        "d",
        "dl",
        "r",
        "rl",
        "md",
        "pulls",
        "seq",
        "relay",
        "relay_tokens",
        "t_relay_last",
        "handed",
        "wan",
        "wan_planned",
        "wan_place",
        "t_prev",
        "off",
        "after",
        "warm",
        "catch_up",
        "row",
    )

    def __init__(self, rid: int, req: Request, sess: Session, gen: int, full: KeyChain, block: int):
        self.rid = rid
        self.req = req
        self.sess = sess
        self.gen = gen
        self.pipe = Pipeline.colocated
        self.full = full
        """Keys of the turn's whole stream (prompt + output): what a finished request leaves."""
        self.keys = full.head(req.prompt_tokens // block)
        """Keys of the prompt: what routing looks up."""
        self.t_first = -1.0
        self.t_last = -1.0
        self.gap = 0.0
        self.done = False
        self.p: Instance | None = None
        self.pl: Lease | None = None
        self.d: Instance | None = None
        """The replica that finishes the request (MD, the PD decoder, or RLD on P-RLD)."""
        self.dl: Lease | None = None
        self.r: Instance | None = None
        self.rl: Lease | None = None
        self.md: Instance | None = None
        """The main decoder routing chose (PDD)."""
        self.pulls = 0
        self.seq: Seq | None = None
        """The relay's running sequence (None once RLD's request ended: finished, capped or aborted)."""
        self.relay: RelayMachine | None = None
        """The relay's state machine (app/policy.py RelayMachine), as the conductor runs it."""
        self.relay_tokens = 0
        self.t_relay_last = -1.0
        self.handed = False
        self.wan = 0
        self.wan_planned = 0
        """KV bytes routing expected MD to pull over the WAN (what joins the link's backlog)."""
        self.wan_place = 0.0
        """That pull's place in the link's backlog, to settle what it did not move."""
        self.t_prev = -1.0
        """Client time of the token before the decode in progress (for its first gap)."""
        self.off = 0.0
        """One-way latency from the decoding replica to the client."""
        self.after: Warm | None = None
        """An earlier turn's MD work covering this prompt: MD's pull starts once it ends."""
        self.warm: Warm | None = None
        """This request's MD warm-up (P-RLD-MD), while it runs."""
        self.catch_up: Warm | None = None
        """MD catching up on the turn the relay finished, while it runs."""
        self.row = -1
        """Its row in the run's Results once finished."""
