"""The twin's PDD pipelines (app/conductor/relay.py): a part of `Twin` (app/sim/twin.py),
which holds the state and the steps every mode shares.

MD is routed first, then the pipeline chosen, then P routed.
- P-MD: the first token from P; MD pulls only what it lacks over the WAN
  and continues.
- P-RLD-MD: the first token from P; RLD pulls over the intra-DC link and
  decodes while MD warms (pulls over the WAN, then computes the first
  token's KV). MD work of an earlier turn still running on that MD (its
  warm-up, or its catch-up on a turn the relay finished) counts towards the
  hit estimate, and MD's pull (on P-MD too) waits for it, at most
  kv.transfer_timeout_s, as the conductor's await_warm does. Each finished
  MD step is a handoff decision: a catch-up round (MD computes the eager
  tokens so far while RLD keeps going) or the final one (RLD is aborted,
  MD computes the rest and continues the stream). At its cap RLD's request
  ends, as relay.py aborts it, and the stream waits for MD's next step,
  which is then the final one. A request RLD finishes before any
  handoff ends there; MD's step in flight still completes and lands in its
  cache.
- P-P-MD (no relay decoder alive): P-RLD-MD with the prefill instance as
  the relay; it holds the prompt, so nothing crosses the intra-DC link.
- P-RLD (singular filter; WAN down; no main decoder alive): RLD decodes
  everything. Outages (`Outage`) set those facts for requests routed
  during them; a transfer cannot start on a down link until it is back.

P-MD's gap is predicted as the conductor does (`Gaps`, app/sim/jobs.py): the
pull, MD's wait, its token's way back, and the correction earlier P-MD turns'
gaps taught.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.config import RoleName
from app.policy import (
    ClusterFacts,
    HandoffStep,
    Pipeline,
    RelayMachine,
    RelayPhase,
    RequestFacts,
    blocks_missing,
    choose_pipeline,
)
from app.sim.engine import Instance
from app.sim.jobs import Gaps, Job
from app.sim.work import WAITING, PrefillJob, Seq

P_MD, P_RLD_MD, P_RLD, P_P_MD, P_D_NAIVE, P_D_CROSS = Pipeline.p_md, Pipeline.p_rld_md, Pipeline.p_rld, Pipeline.p_p_md, Pipeline.p_d_naive, Pipeline.p_d_cross

if TYPE_CHECKING:
    from typing import Protocol

    from app.config import HandoffConfig, RoutingConfig
    from app.policy import LinkBacklog, LinkFacts
    from app.sim.events import Loop
    from app.sim.network import Link
    from app.sim.pending import PendingMDWork
    from app.sim.results import Results
    from app.sim.routing import KeyChain, RunIndex

    class PipelineHost(Protocol):
        """What the pipelines' methods use of the class they are part of (`Twin`, app/sim/twin.py):
        its state and shared steps, and the pipelines' own methods. Type checkers only: the
        compiled build declares the state on PDDPipelines (pdd.pxd)."""

        loop: Loop
        block: int
        block_bytes: int
        routing: RoutingConfig
        handoff: HandoffConfig
        R: list[Instance]
        intra: Link | None
        wan: Link | None
        ow: float
        wan_facts: LinkFacts | None
        wan_backlog: LinkBacklog | None
        pending: PendingMDWork
        decoder_overhead_s: float
        index: RunIndex
        results: Results
        _cluster_facts: dict[tuple[float, bool, bool, bool], ClusterFacts]
        gaps: Gaps | None

        # Twin's steps every mode shares
        def _down(self, kind: str) -> bool: ...
        def _route(self, role: RoleName, keys: KeyChain) -> tuple[Instance, int]: ...
        def _settle(self, job: Job) -> None: ...
        def _finish(self, job: Job) -> None: ...
        def _first_token(self, job: Job, t: float) -> bool: ...
        def _prefill(self, job: Job, inst: Instance, need: int, cb: Callable[[PrefillJob], None]) -> None: ...
        def _start_prefill(self, job: Job, cb: Callable[[PrefillJob], None]) -> None: ...
        def _prefilled(self, job: Job) -> None: ...
        def _open_decoder(self, job: Job, inst: Instance, prefix_tokens: int) -> None: ...
        def _decode(
            self, job: Job, inst: Instance, ctx: int, n: int, t_prev: float, off: float, cb: Callable[[Seq, float], None] | None = None, pulled: bool = False
        ) -> Seq: ...
        def _send(self, link: Link, to: Instance, job: Job, blocks: int, done: Callable[[Job], None]) -> None: ...
        def _pull_done(self, job: Job) -> None: ...

        # PDDPipelines' own
        def _relay_on(self, job: Job, relay: Instance, load: float) -> None: ...
        @staticmethod
        def _streams(inst: Instance) -> int: ...
        def _pdd_first(self, pj: PrefillJob) -> None: ...
        def _main_pull(self, job: Job) -> None: ...
        def _singular_pulled(self, job: Job) -> None: ...
        def _end_relay(self, job: Job, keep: int) -> None: ...
        def _relay_pulled(self, job: Job) -> None: ...
        def _start_relay(self, job: Job) -> None: ...
        def _relay_decode(self, job: Job, ctx: int, n: int, cb: Callable[[Seq, float], None], pulled: bool = False) -> Seq: ...
        def _relay_stopped(self, seq: Seq, worst: float) -> None: ...
        def _main_pulled(self, job: Job) -> None: ...
        def _md_step_done(self, pj: PrefillJob) -> None: ...
        def _handoff(self, job: Job) -> None: ...
        def _md_caught_up(self, pj: PrefillJob) -> None: ...
        def _extend(self, job: Job, sent: int, upto: int, final: bool) -> None: ...
        def _handed_over(self, pj: PrefillJob) -> None: ...


class PDDPipelines:
    """Twin's methods for the pdd mode: `_pdd` starts a request; the rest follow its events."""

    @cython.locals(job=Job)
    def _pdd(self: PipelineHost, job: Job) -> None:
        req = job.req
        now = self.loop.now
        gaps = self.gaps
        assert gaps is not None and self.wan_facts is not None and self.wan_backlog is not None  # the pdd mode's P and MD: a WAN between them
        md, md_cached = None, 0
        md_wait = correction = 0.0
        if not self._down("main_decode"):  # Placement.route raises when no main decoder is alive
            md, md_cached = self._route(RoleName.main_decode, job.keys)
            # a previous turn's MD work still running there: count its blocks, wait for it
            job.after, covered = self.pending.covering(md.name, job.keys)
            md_cached = max(md_cached, covered * self.block)
            md_wait, correction = gaps.md_wait_ms(md), gaps.correction_ms(md.name, now)
        job.md = md
        # relay.rld_load: the least loaded relay decoder and its occupancy
        rld = min(self.R, key=self._streams) if self.R and not self._down("relay_decode") else None
        load = rld.streams / rld.max_seqs if rld is not None else 1.0
        key = (load, rld is not None, not self._down("wan"), md is not None)
        queued = self.wan_backlog.queued(now)
        if queued or md_wait or correction:  # this request's own facts: built whole, cheaper than replacing fields
            facts = ClusterFacts(self.block_bytes, self.block, self.wan_facts, *key, wan_backlog_bytes=queued, md_wait_ms=md_wait, gap_correction_ms=correction)
        else:  # frozen, and few distinct values: built once each
            facts = self._cluster_facts.get(key) or self._cluster_facts.setdefault(key, ClusterFacts(self.block_bytes, self.block, self.wan_facts, *key))
        decision = choose_pipeline(RequestFacts(req.prompt_tokens, req.output_tokens, md_cached), facts, self.routing)
        job.pipe = pipe = decision.pipeline
        job.wan_planned = decision.blocks_to_send * self.block_bytes
        if pipe is P_MD:  # what its gap corrects: the prediction without the correction (GapModel.timed)
            job.gap_predicted = decision.uncorrected_gap_ms
        elif pipe is P_RLD_MD or pipe is P_RLD:
            assert rld is not None  # chosen only with a relay decoder alive
            self._relay_on(job, rld, load)
        self._start_prefill(job, self._pdd_first)

    @cython.locals(job=Job)
    def _relay_on(self: PipelineHost, job: Job, relay: Instance, load: float) -> None:
        """The relay's instance, and its machine (cap, handoff mode) from its occupancy (relay.Relay)."""
        job.r = relay
        job.relay = RelayMachine.start(self.handoff, load)

    @staticmethod
    def _streams(inst: Instance) -> int:
        return inst.streams

    @cython.locals(pj=PrefillJob, job=Job)
    def _pdd_first(self: PipelineHost, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        self._prefilled(job)
        assert job.p is not None and job.pl is not None  # P prefilled it
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        pipe = job.pipe
        prompt = req.prompt_tokens
        if pipe is P_RLD:
            if job.md is not None:  # singular, or WAN down: MD never sees this request
                self.index.unroute(job.md.name, job.keys)
            assert job.r is not None and self.intra is not None  # _relay_on; the link to RLD's datacenter
            self._open_decoder(job, job.r, req.prefix_tokens)
            job.rl = job.dl
            assert job.rl is not None  # _open_decoder's lease
            job.pulls = 1
            self._send(self.intra, job.r, job, blocks_missing(prompt, job.rl.hit, self.block), self._singular_pulled)
            return
        if pipe is P_MD:
            job.pulls = 1
        else:
            if pipe is P_P_MD:  # relay.occupancy: P's own, now that its prefill is done
                self._relay_on(job, job.p, job.p.streams / job.p.max_seqs)
            r = job.r
            assert r is not None and job.md is not None  # P-RLD-MD, P-P-MD: a relay, and a main decoder alive
            r.streams += 1
            job.rl = r.open(req.session, req.prefix_tokens, job.sess.divs, job.gen)
            if pipe is P_P_MD:  # P holds the prompt: nothing crosses the intra-DC link
                job.pulls = 1
                self.loop.at(self.loop.now + self.decoder_overhead_s, self._start_relay, job)
            else:
                job.pulls = 2
                assert self.intra is not None  # the link to RLD's datacenter
                self._send(self.intra, r, job, blocks_missing(prompt, job.rl.hit, self.block), self._relay_pulled)
            job.warm = self.pending.track(job.md.name, job.keys)
        self.pending.after(job.after, self._main_pull, job)

    @cython.locals(job=Job)
    def _main_pull(self: PipelineHost, job: Job) -> None:
        """MD pulls what it lacks over the WAN (after the earlier turn's MD work it waited for)."""
        req = job.req
        assert job.md is not None and self.wan is not None and self.wan_backlog is not None  # routed in _pdd, over the WAN
        self._open_decoder(job, job.md, req.prefix_tokens)
        assert job.dl is not None  # _open_decoder's lease
        if job.done:  # the relay finished the request while MD's pull waited
            self.results.set_decode_hit(job.row, job.dl.hit)
        job.wan_place = self.wan_backlog.add(job.wan_planned, self.loop.now)
        self._send(self.wan, job.md, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._main_pulled)

    @cython.locals(job=Job)
    def _singular_pulled(self: PipelineHost, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        assert job.d is not None  # RLD (_open_decoder)
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0, pulled=True)

    @cython.locals(job=Job)
    def _end_relay(self: PipelineHost, job: Job, keep: int) -> None:
        """RLD's request is over (finished, or aborted at the handoff): its blocks stay cached."""
        assert job.r is not None and job.rl is not None  # the relay's request
        job.r.streams -= 1
        job.r.close(job.rl, keep, job.gen)
        job.seq = None

    @cython.locals(job=Job)
    def _relay_pulled(self: PipelineHost, job: Job) -> None:
        self._pull_done(job)
        self._start_relay(job)

    @cython.locals(job=Job)
    def _start_relay(self: PipelineHost, job: Job) -> None:
        req = job.req
        if job.handed:  # MD took over before the relay could start: its request was aborted
            self._end_relay(job, req.prompt_tokens)
            return
        assert job.relay is not None  # _relay_on
        n = min(job.relay.cap, req.output_tokens - 1)
        job.seq = self._relay_decode(job, req.prompt_tokens + 1, n, self._relay_stopped, pulled=True)

    @cython.locals(job=Job)
    def _relay_decode(self: PipelineHost, job: Job, ctx: int, n: int, cb: Callable[[Seq, float], None], pulled: bool = False) -> Seq:
        assert job.r is not None and job.rl is not None  # the relay's request
        seq = Seq(job, ctx, n, ctx + n, job.rl, cb, pulled)
        job.r.submit_decode(seq)
        return seq

    @cython.locals(seq=Seq, job=Job)
    def _relay_stopped(self: PipelineHost, seq: Seq, worst: float) -> None:
        """RLD produced the last token the client takes from it: the request's end, or the cap."""
        job: Job = seq.owner
        now = self.loop.now
        req = job.req
        job.gap = max(job.gap, seq.t_first - job.t_first, worst)
        job.relay_tokens = seq.n
        job.t_relay_last = now
        assert job.relay is not None and job.md is not None  # P-RLD-MD, P-P-MD
        job.relay.take(seq.n - job.relay.relayed, seq.n == req.output_tokens - 1)
        if job.relay.phase is RelayPhase.relay_finished:  # RLD ended the request before the handoff
            self._end_relay(job, req.prompt_tokens + req.output_tokens - 1)
            job.catch_up = self.pending.track(job.md.name, job.full)  # MD catches up on the answer: the next turn waits for it
            job.t_last = now
            self._finish(job)
            return
        # at the cap: RLD's request ends (relay.py aborts it), and the stream waits for MD
        self._end_relay(job, seq.ctx + seq.n)

    @cython.locals(job=Job)
    def _main_pulled(self: PipelineHost, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        assert job.d is not None and job.dl is not None and self.wan_backlog is not None  # MD pulled over the WAN
        # MD's report: what it moved, beside routing's estimate (EngineOps.decode_stream)
        moved = blocks_missing(req.prompt_tokens, job.dl.hit, self.block) * self.block_bytes
        if moved < job.wan_planned:
            self.wan_backlog.settle(job.wan_place, job.wan_planned, moved, self.loop.now)
        if job.pipe is P_MD:  # MD's request decodes as soon as its pull lands; its first token corrects the gap prediction
            seq = self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, self.ow, pulled=True)
            assert self.gaps is not None  # the pdd mode's
            self.gaps.watch(seq)
            return
        # the warm request: MD computes the first token's KV (its own sampled token is discarded)
        job.d.submit_prefill(PrefillJob(job, 1, req.prompt_tokens, req.prompt_tokens + 1, job.dl, self._md_step_done))

    @cython.locals(pj=PrefillJob)
    def _md_step_done(self: PipelineHost, pj: PrefillJob) -> None:
        self.loop.at(self.loop.now + self.ow, self._handoff, pj.owner)

    @cython.locals(job=Job)
    def _handoff(self: PipelineHost, job: Job) -> None:
        """The conductor learns MD finished a step (the warm-up or a catch-up round)."""
        now = self.loop.now
        req = job.req
        md = job.d
        assert md is not None and job.dl is not None and job.r is not None and job.relay is not None  # P-RLD-MD, P-P-MD
        if job.warm is not None:  # the warm-up's blocks are MD's cache now
            md.publish(job.dl, req.prompt_tokens + 1, job.gen)
            self.pending.done(md.name, job.warm)
            job.warm = None
        if job.done:  # RLD finished the request: MD's steps only bring its cache along
            self.index.record(md.name, job.full.head((req.prompt_tokens + 1) // self.block), md.kv_blocks)
            sent = job.relay.sent
            behind = req.output_tokens - 1 - sent
            if behind > 0:  # relay.py: MD extends over the relay's tokens, in the background
                pj = PrefillJob(job, behind, req.prompt_tokens + 1 + sent, req.prompt_tokens + req.output_tokens, job.dl, self._md_caught_up)
                md.submit_prefill(pj)
                return
            md.streams -= 1
            md.close(job.dl, req.prompt_tokens + 1 + sent, job.gen)
            self.pending.done(md.name, job.catch_up)
            return
        md.streams -= 1
        seq, relay = job.seq, job.relay
        sent, capped = relay.sent, relay.phase is RelayPhase.waiting
        if seq is not None and relay.phase is RelayPhase.relaying:  # RLD's tokens so far reach the client
            produced, _ = job.r.tokens_by(seq, now)
            relay.take(produced - relay.relayed, False)
        if relay.md_step_done() is HandoffStep.catch_up:
            self._extend(job, sent, relay.sent, final=False)
            return
        if seq is None:  # RLD's request ended at its cap, or the relay has not started
            job.handed = not capped  # not started: its request is aborted when it would start
            self._extend(job, sent, relay.relayed, final=True)
            return
        started = seq.state != WAITING
        produced, t_last, worst = job.r.abort(seq, now)
        if started and produced:
            job.gap = max(job.gap, worst, seq.t_first - job.t_first)
            job.t_relay_last = t_last
        job.relay_tokens = produced
        self._end_relay(job, req.prompt_tokens + 1 + produced)
        self._extend(job, sent, produced, final=True)

    @cython.locals(pj=PrefillJob, job=Job)
    def _md_caught_up(self: PipelineHost, pj: PrefillJob) -> None:
        """MD holds the whole turn the relay finished."""
        job: Job = pj.owner
        md, req = job.d, job.req
        assert md is not None and job.dl is not None  # MD (_main_pull)
        md.streams -= 1
        md.close(job.dl, req.prompt_tokens + req.output_tokens, job.gen)
        self.index.record(md.name, job.full, md.kv_blocks)
        self.pending.done(md.name, job.catch_up)

    @cython.locals(job=Job)
    def _extend(self: PipelineHost, job: Job, sent: int, upto: int, final: bool) -> None:
        """A new MD request: prompt + the tokens the client has, of which MD computes the
        relay tokens past the `sent` it already has in one extend step (at least one token).
        A catch-up request stops there; the final one decodes the rest."""
        req = job.req
        ctx = req.prompt_tokens + 1 + sent
        tokens = upto - sent
        if final:
            need, cb = req.prompt_tokens + req.output_tokens, self._handed_over
        else:
            need, cb = req.prompt_tokens + 1 + upto, self._md_step_done
        assert job.d is not None and job.dl is not None  # MD (_main_pull)
        job.d.streams += 1
        pj = PrefillJob(job, max(1, tokens), ctx, need, job.dl, cb)
        self.loop.at(self.loop.now + self.ow + self.decoder_overhead_s, _submit, (job.d, pj))

    @cython.locals(pj=PrefillJob, job=Job)
    def _handed_over(self: PipelineHost, pj: PrefillJob) -> None:
        """MD's final extend step produced the token after the relay's last one."""
        job: Job = pj.owner
        req = job.req
        t = self.loop.now + self.ow
        job.gap = max(job.gap, t - job.t_relay_last)
        left = req.output_tokens - 2 - job.relay_tokens
        assert job.d is not None and job.dl is not None  # MD (_main_pull)
        if left <= 0:
            job.t_last = t
            job.d.close(job.dl, req.prompt_tokens + req.output_tokens - 1, job.gen)
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + job.relay_tokens + 2, left, t, self.ow)


def _submit(arg: tuple[Instance, PrefillJob]) -> None:
    arg[0].submit_prefill(arg[1])
