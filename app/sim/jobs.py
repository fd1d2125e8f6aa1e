"""The conductor's bookkeeping: one conversation (`Session`), one request (`Job`), the gaps
routing predicts (`Gaps`)."""

from __future__ import annotations

from collections.abc import Iterable

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.policy import GapCorrection, Pipeline, RelayMachine, decoder_wait_ms
from app.sim.engine import Instance
from app.sim.pending import Warm
from app.sim.routing import Conversation, KeyChain
from app.sim.work import WAITING, Lease, Seq
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
        "gap_predicted",
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
        self.gap_predicted = 0.0
        """P-MD: the gap routing predicted (ms) without its correction, which the gap seen corrects."""
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


class Gaps:
    """The conductor's model of the gap a P-MD turn causes (app/conductor/gaps.py `GapModel`), as the twin holds it.

    MD's wait (`policy.decoder_wait_ms`) takes MD's decode step now: its running batch (a lone sequence's when
    idle), by its model, on its host as busy as it is; the conductor reads that interval off MD's streams. The
    run's `GapCorrection` is keyed by the WAN's name and MD's. A P-MD turn's MD sequence (`watch`) corrects it
    when MD's first token reaches the conductor: that token has no event of its own here, its time is known once
    MD plans the step that makes it, so each routing first applies the turns seen by then, in order, each at its
    time; routing alone reads the correction, so it sees what the conductor would have."""

    __slots__ = ("correction", "keys", "pending", "ow")

    def __init__(self, wan: str, mds: Iterable[str], ow: float):
        self.correction = GapCorrection()
        self.keys = {md: f"{wan}|{md}" for md in mds}
        self.pending: list[Seq] = []
        """P-MD turns' MD sequences whose first token has not corrected the prediction yet."""
        self.ow = ow
        """One-way latency of MD's tokens to the conductor."""

    @cython.locals(md=Instance)
    def md_wait_ms(self, md: Instance) -> float:
        p0, _, q0, _ = md.perf.decode_lines(md.n or 1, md.kv)
        step = p0 if p0 > q0 else q0
        if md.host is not None:
            step *= md._slowdown()
        return decoder_wait_ms(step * 1000, md.streams, md.max_seqs)

    def correction_ms(self, md: str, now: float) -> float:
        if self.pending:
            self._observe(now)
        return self.correction.value(self.keys[md], now)

    def watch(self, seq: Seq) -> None:
        """A P-MD turn's MD sequence (`seq.owner.gap_predicted`: routing's prediction without the correction)."""
        self.pending.append(seq)

    @cython.locals(seq=Seq, job=Job)
    def _observe(self, now: float) -> None:
        ow = self.ow
        ready = [seq for seq in self.pending if seq.state != WAITING and seq.t_first + ow <= now]
        if not ready:
            return
        self.pending = [seq for seq in self.pending if seq.state == WAITING or seq.t_first + ow > now]
        if len(ready) > 1:
            ready.sort(key=_first_token_time)
        for seq in ready:
            job = seq.owner
            assert job.md is not None  # P-MD
            t = seq.t_first + ow
            self.correction.observe(self.keys[job.md.name], job.gap_predicted, (t - job.t_first) * 1000, t)


@cython.locals(seq=Seq)
def _first_token_time(seq: Seq) -> float:
    return seq.t_first
