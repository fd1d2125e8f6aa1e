"""The twin's conductor: every request through its mode's pipeline.

Decisions are app.policy's, called with the facts the twin holds (the same
functions the real conductor calls): the replica by conversation affinity
(`pick_replica`), the pipeline (`choose_pipeline`), what crosses a link
(`blocks_missing`), the relay's cap (`relay_cap`) and the handoff
(`resolve_handoff_mode`, `next_handoff_step`). What is not a decision is
physics: engines (app/sim/engine.py) and links (app/sim/network.py).

A conversation's turns are sequential: a turn due while the previous one
still runs is sent when that one finishes (an agent waits for the answer),
and its latencies count from then.

Placement: the client and the conductor sit with the first role of the
pipeline (prefill, or main_decode when colocated). Tokens and control
messages from another datacenter pay half the link's base RTT.

Pipelines (../shared/PDD.md, ../shared/DESIGN.md):
- colocated: main_decode prefills and decodes.
- pd_intra_dc (P-D): P prefills and streams the first token; relay_decode
  pulls the blocks it lacks over the intra-DC link and decodes the rest.
- pd_cross_dc_naive (P-D-naive): main_decode pulls the full prompt KV over
  the WAN (its own cache unused), computes the first token's KV and only then
  do tokens 1 and 2 reach the client.
- pdd, P-MD: the first token from P; MD pulls only what it lacks over the WAN.
- pdd, P-RLD-MD: the first token from P; RLD pulls over the intra-DC link and
  decodes eagerly (up to its cap) while MD pulls over the WAN; then MD
  recomputes the eager tokens in extend steps (catch-up rounds while RLD
  keeps going, then a final one that stops RLD) and continues the stream.
  A request that RLD finishes before MD is ready ends on RLD; MD's pull still
  lands in its cache. Once RLD has stopped at its cap, the next round is the
  final one: there is nothing left to overlap.
- pdd, P-RLD (singular filter): RLD decodes everything.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator

from app.config import Mode, PDDConfig, RoleName
from app.policy import (
    ClusterFacts,
    HandoffStep,
    LinkFacts,
    Pipeline,
    RequestFacts,
    blocks_missing,
    choose_pipeline,
    next_handoff_step,
    pick_replica,
    relay_cap,
    resolve_handoff_mode,
)
from app.sim.cluster import PerfArg, SimCluster, build_cluster, model_spec
from app.sim.engine import DONE, Instance, Lease, PrefillJob, Seq
from app.sim.events import Loop
from app.sim.jobs import Job, Session
from app.sim.results import Results
from app.sim.workload import Request



class Twin:
    """One simulation run of a config; `run(requests)` serves them all and returns Results."""

    def __init__(self, config: PDDConfig, perf: PerfArg = None, seed: int = 0,
                 progress: Callable[[int], None] | None = None):
        self.config = config
        self.mode = config.mode
        self.loop = Loop()
        self.cluster: SimCluster = build_cluster(config, self.loop, self.mode, perf, seed)
        spec = model_spec(config)
        self.block = config.model.block_size
        self.block_bytes = spec.kv_bytes_per_token * self.block
        self.routing = config.routing
        self.handoff = config.handoff
        pools = self.cluster.pools
        self.P = pools.get(RoleName.prefill, [])
        self.R = pools.get(RoleName.relay_decode, [])
        self.M = pools.get(RoleName.main_decode, [])
        dc = self.cluster.datacenter
        client = dc[RoleName.prefill] if RoleName.prefill in dc else dc[RoleName.main_decode]
        self.intra = self.cluster.link(client, dc[RoleName.relay_decode]) if self.R else None
        self.wan = self.cluster.link(client, dc[RoleName.main_decode]) if self.M and self.P else None
        # one-way latency of tokens and control messages from main_decode to the client
        self.ow = self.wan.model.config.rtt_ms / 2000 if self.wan and self.wan.wan else 0.0
        self.wan_facts = (LinkFacts(self.wan.bw, self.wan.model.config.rtt_ms / 1000) if self.wan else None)
        self._cluster_facts: dict[float, ClusterFacts] = {}
        self.sessions: dict[object, Session] = {}
        self.results = Results()
        self.progress = progress
        self.finished = 0
        self.delayed_turns = 0
        self._arrivals: Iterator[Request] = iter(())
        self._rid = 0

    # ---- driving -----------------------------------------------------------------

    def run(self, requests: Iterable[Request]) -> Results:
        it = self._arrivals = iter(requests)
        first = next(it, None)
        if first is not None:
            self.loop.at(first.arrival_s, self._arrive, first)
        # the run's objects form no reference cycles that outlive a request (the one
        # job <-> relay sequence link is cut at the end), so the cyclic collector
        # would only rescan them: it halves the speed on long runs
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run()
        finally:
            if collecting:
                gc.enable()
        return self.results

    def _arrive(self, req: Request) -> None:
        nxt = next(self._arrivals, None)
        if nxt is not None:
            self.loop.at(nxt.arrival_s, self._arrive, nxt)
        sess = self.sessions.get(req.session)
        if sess is None:
            sess = self.sessions[req.session] = Session()
        if sess.busy:
            sess.waiting.append(req)
            self.delayed_turns += 1
            return
        self._dispatch(req, sess)

    def _dispatch(self, req: Request, sess: Session) -> None:
        sess.busy = True
        if req.prefix_tokens < sess.stream:
            sess.divs.append(req.prefix_tokens)
        sess.stream = req.prompt_tokens + req.output_tokens
        job = Job(self._rid, req, sess, len(sess.divs))
        self._rid += 1
        mode = self.mode
        if mode is Mode.pdd:
            self._pdd(job)
        elif mode is Mode.colocated:
            self._colocated(job)
        elif mode is Mode.pd_intra_dc:
            self._pd(job)
        else:
            self._naive(job)

    def _pick(self, pool: list[Instance], sess: Session, attr: str) -> Instance:
        preferred = getattr(sess, attr)
        # with a preferred replica the choice reads only how many there are: skip gathering loads
        loads = pool if preferred is not None else [inst.active for inst in pool]
        i = pick_replica(preferred, loads)
        setattr(sess, attr, i)
        return pool[i]

    def _finish(self, job: Job) -> None:
        if job.done:
            raise AssertionError(f"request {job.rid} finished twice")
        job.done = True
        job.seq = None
        req = job.req
        self.results.add(job.rid, req.arrival_s, job.t_first, job.t_last, job.gap, job.pipe, req.prompt_tokens,
                         req.output_tokens, job.pl.hit if job.pl else 0, job.dl.hit if job.dl else 0,
                         job.relay_tokens, job.wan)
        self.finished += 1
        if self.progress is not None and not self.finished & 0xFFF:
            self.progress(self.finished)
        sess = job.sess
        sess.busy = False
        if sess.waiting:
            self._dispatch(sess.waiting.pop(0)._replace(arrival_s=self.loop.now), sess)

    def _first_token(self, job: Job, t: float) -> bool:
        """Record the first token; True when it was also the last."""
        job.t_first = t
        if job.req.output_tokens == 1:
            job.t_last = t
            return True
        return False

    def _prefill(self, job: Job, inst: Instance, lease: Lease, need: int, cb: Callable[[PrefillJob], None]) -> None:
        prompt = job.req.prompt_tokens
        hit = lease.hit if lease.hit < prompt else prompt - 1
        inst.submit_prefill(PrefillJob(job, prompt - hit, hit, need, lease, cb))

    def _decode(self, job: Job, inst: Instance, lease: Lease, ctx: int, n: int, t_prev: float, off: float,
                cb: Callable[[Seq, float], None] | None = None) -> Seq:
        """Continue the stream on `inst` from `ctx` tokens; its tokens reach the client `off` later."""
        job.t_prev = t_prev
        job.off = off
        seq = Seq(job, ctx, n, ctx + n, lease, cb or self._decoded)
        inst.submit_decode(seq)
        return seq

    def _decoded(self, seq: Seq, worst: float) -> None:
        job: Job = seq.owner
        off = job.off
        job.gap = max(job.gap, seq.t_first + off - job.t_prev, worst)
        job.t_last = self.loop.now + off
        req = job.req
        seq.inst.close(seq.lease, req.prompt_tokens + req.output_tokens - 1, job.gen)
        self._finish(job)

    def _send(self, link, job: Job, blocks: int, done: Callable[[Job], None]) -> None:
        nbytes = blocks * self.block_bytes
        if link.wan:
            job.wan += nbytes
        link.send(nbytes, done, job)

    def _pull_done(self, job: Job) -> None:
        """One consumer has P's KV; P's blocks are free (cached) once all have."""
        job.pulls -= 1
        if job.pulls == 0:
            job.p.close(job.pl, job.req.prompt_tokens, job.gen)

    # ---- colocated -------------------------------------------------------------------

    def _colocated(self, job: Job) -> None:
        job.pipe = Pipeline.colocated
        req = job.req
        d = job.d = self._pick(self.M, job.sess, "main")
        job.dl = job.pl = d.open(req.session, req.prefix_tokens, job.sess.divs)  # one engine: one lease
        self._prefill(job, d, job.dl, req.prompt_tokens + req.output_tokens, self._colocated_first)

    def _colocated_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        now = self.loop.now
        req = job.req
        if self._first_token(job, now):
            job.d.close(job.dl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        self._decode(job, job.d, job.dl, req.prompt_tokens + 1, req.output_tokens - 1, now, 0.0)

    # ---- classic PD ------------------------------------------------------------------

    def _open_prefill(self, job: Job) -> None:
        req = job.req
        p = job.p = self._pick(self.P, job.sess, "prefill")
        job.pl = p.open(req.session, req.prefix_tokens, job.sess.divs)

    def _pd(self, job: Job) -> None:
        job.pipe = Pipeline.p_d
        req = job.req
        self._open_prefill(job)
        d = job.d = self._pick(self.R, job.sess, "relay")
        job.dl = d.open(req.session, req.prefix_tokens, job.sess.divs)
        self._prefill(job, job.p, job.pl, req.prompt_tokens, self._pd_first)

    def _pd_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            job.d.close(job.dl, job.dl.hit, job.gen)
            self._finish(job)
            return
        job.pulls = 1
        self._send(self.intra, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._pd_pulled)

    def _pd_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        self._decode(job, job.d, job.dl, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0)

    def _naive(self, job: Job) -> None:
        job.pipe = Pipeline.p_d_naive
        req = job.req
        self._open_prefill(job)
        d = job.d = self._pick(self.M, job.sess, "main")
        job.dl = d.open(req.session, 0, job.sess.divs)  # the naive decoder skips its prefix cache
        self._prefill(job, job.p, job.pl, req.prompt_tokens, self._naive_prefilled)

    def _naive_prefilled(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        if req.output_tokens == 1:
            self._first_token(job, self.loop.now)
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            job.d.close(job.dl, 0, job.gen)
            self._finish(job)
            return
        job.pulls = 1
        self._send(self.wan, job, blocks_missing(req.prompt_tokens, 0, self.block), self._naive_pulled)

    def _naive_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        # the decoder computes the first token's KV, producing token 2: both reach the client then
        job.d.submit_prefill(PrefillJob(job, 1, req.prompt_tokens, req.prompt_tokens + req.output_tokens, job.dl,
                                        self._naive_second))

    def _naive_second(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        t = self.loop.now + self.ow
        job.t_first = t
        if req.output_tokens <= 2:
            job.t_last = t
            job.d.close(job.dl, req.prompt_tokens + req.output_tokens - 1, job.gen)
            self._finish(job)
            return
        self._decode(job, job.d, job.dl, req.prompt_tokens + 2, req.output_tokens - 2, t, self.ow)

    # ---- PDD -------------------------------------------------------------------------

    def _pdd(self, job: Job) -> None:
        req = job.req
        sess = job.sess
        md = self._pick(self.M, sess, "main")
        # the least loaded relay: the one ClusterFacts.rld_load describes
        relay_loads = [r.relays / r.max_seqs for r in self.R]
        relay_i = pick_replica(None, relay_loads) if relay_loads else 0
        relay_load = relay_loads[relay_i] if relay_loads else 1.0
        facts = self._cluster_facts.get(relay_load)
        if facts is None:  # frozen and few distinct loads: built once per load
            facts = self._cluster_facts[relay_load] = ClusterFacts(self.block_bytes, self.block, self.wan_facts, relay_load, bool(self.R))
        decision = choose_pipeline(
            RequestFacts(req.prompt_tokens, req.output_tokens, md.cached_for(req.session, req.prefix_tokens, sess.divs)),
            facts,
            self.routing,
        )
        job.pipe = pipe = decision.pipeline
        self._open_prefill(job)
        if pipe is not Pipeline.p_rld:
            job.d = md
            job.dl = md.open(req.session, req.prefix_tokens, sess.divs)
        if pipe is not Pipeline.p_md:
            r = job.r = self.R[relay_i]
            job.rl = r.open(req.session, req.prefix_tokens, sess.divs)
            r.relays += 1
            job.relay_open = True
            job.cap = relay_cap(self.handoff, relay_load)
            job.hmode = resolve_handoff_mode(self.handoff, relay_load)
        self._prefill(job, job.p, job.pl, req.prompt_tokens, self._pdd_first)

    def _end_relay(self, job: Job) -> None:
        if job.relay_open:
            job.relay_open = False
            job.r.relays -= 1

    def _pdd_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            if job.dl is not None:
                job.d.close(job.dl, job.dl.hit, job.gen)
            if job.rl is not None:
                self._end_relay(job)
                job.r.close(job.rl, job.rl.hit, job.gen)
            self._finish(job)
            return
        pipe = job.pipe
        job.pulls = (pipe is not Pipeline.p_rld) + (pipe is not Pipeline.p_md)
        if pipe is not Pipeline.p_md:
            self._send(self.intra, job, blocks_missing(req.prompt_tokens, job.rl.hit, self.block), self._relay_pulled)
        if pipe is not Pipeline.p_rld:
            self._send(self.wan, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._main_pulled)

    def _relay_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        if job.pipe is Pipeline.p_rld:
            self._decode(job, job.r, job.rl, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0,
                         self._singular_done)
            return
        if job.handed:  # MD took over before the relay could start
            self._end_relay(job)
            job.r.close(job.rl, req.prompt_tokens, job.gen)
            return
        n = min(job.cap, req.output_tokens - 1)
        job.seq = self._decode(job, job.r, job.rl, req.prompt_tokens + 1, n, job.t_first, 0.0, self._relay_stopped)

    def _singular_done(self, seq: Seq, worst: float) -> None:
        self._end_relay(seq.owner)
        self._decoded(seq, worst)

    def _relay_stopped(self, seq: Seq, worst: float) -> None:
        """RLD produced its last token: the request's end, or its cap."""
        job: Job = seq.owner
        now = self.loop.now
        req = job.req
        job.gap = max(job.gap, seq.t_first - job.t_first, worst)
        job.relay_tokens = seq.n
        job.t_relay_last = now
        self._end_relay(job)
        job.r.close(job.rl, req.prompt_tokens + seq.n, job.gen)
        if seq.n == req.output_tokens - 1:
            job.t_last = now
            self._finish(job)

    def _main_pulled(self, job: Job) -> None:
        self._pull_done(job)
        if job.pipe is Pipeline.p_md:  # MD's request decodes as soon as its pull lands
            req = job.req
            self._decode(job, job.d, job.dl, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, self.ow)
            return
        self.loop.at(self.loop.now + self.ow, self._handoff, job)

    def _handoff(self, job: Job) -> None:
        """The conductor learns MD holds the prompt KV (or finished a catch-up round)."""
        now = self.loop.now
        req = job.req
        if job.done:  # RLD finished the request: the pull only warmed MD's cache
            job.d.close(job.dl, req.prompt_tokens, job.gen)
            return
        seq = job.seq
        if seq is None:  # the relay has not started: MD continues from token 1
            job.handed = True
            self._decode(job, job.d, job.dl, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, self.ow)
            return
        produced, t_last = job.r.tokens_by(seq, now)
        stopped = seq.state == DONE
        if not stopped:
            step = next_handoff_step(produced - job.sent, job.rounds, job.hmode, self.handoff)
            if step is HandoffStep.catch_up:
                self._extend(job, produced, self._caught_up)
                job.rounds += 1
                return
            produced, t_last, worst = job.r.abort(seq, now)
            job.gap = max(job.gap, worst, seq.t_first - job.t_first if produced else 0.0)
            job.relay_tokens = produced
            job.t_relay_last = t_last if produced else job.t_first
            self._end_relay(job)
            job.r.close(job.rl, req.prompt_tokens + produced, job.gen)
        self._extend(job, job.relay_tokens, self._handed_over)

    def _extend(self, job: Job, upto: int, cb: Callable[[PrefillJob], None]) -> None:
        """Send MD the eager token ids up to `upto`; it computes their KV in one extend step.

        The first extend also covers the first token (P's), whose KV MD lacks.
        """
        tokens = upto - job.sent + (1 if job.sent == 0 and job.rounds == 0 else 0)
        ctx = job.req.prompt_tokens + (job.sent + 1 if job.rounds or job.sent else 0)
        job.sent = upto
        pj = PrefillJob(job, max(1, tokens), ctx, job.req.prompt_tokens + job.req.output_tokens, job.dl, cb)
        self.loop.at(self.loop.now + self.ow, _submit, (job.d, pj))

    def _caught_up(self, pj: PrefillJob) -> None:
        self.loop.at(self.loop.now + self.ow, self._handoff, pj.owner)

    def _handed_over(self, pj: PrefillJob) -> None:
        """MD's final extend step produced the token after the relay's last one."""
        job: Job = pj.owner
        req = job.req
        t = self.loop.now + self.ow
        job.gap = max(job.gap, t - job.t_relay_last)
        left = req.output_tokens - 2 - job.relay_tokens
        if left <= 0:
            job.t_last = t
            job.d.close(job.dl, req.prompt_tokens + req.output_tokens - 1, job.gen)
            self._finish(job)
            return
        self._decode(job, job.d, job.dl, req.prompt_tokens + job.relay_tokens + 2, left, t, self.ow)


def _submit(arg: tuple[Instance, PrefillJob]) -> None:
    arg[0].submit_prefill(arg[1])
