"""The twin's conductor: every request through its mode's pipeline.

Decisions are the real conductor's, made by the same code on the facts the
twin holds: replicas by app/prefix_index.PrefixIndex (`choose` when routing,
`route` what was sent where, `unroute` what will not land after all, `observe`
the hit the engine reports and `record` what a replica now holds; keys are
synthesised per conversation by app/sim/routing.py), the pipeline by
`policy.choose_pipeline`, what crosses a link by `policy.blocks_missing`, the
relay's cap by `policy.relay_cap` and the handoff by
`policy.resolve_handoff_mode` / `policy.next_handoff_step`. The calls come in
the conductor's order (app/conductor.py, app/relay.py), and the load routing
compares is the conductor's: requests it has in flight on each replica
(`Instance.streams`). What is not a decision is physics: engines
(app/sim/engine.py) and links (app/sim/network.py).

A conversation's turns are sequential: a turn due while the previous one
still runs is sent when that one finishes (an agent waits for the answer),
and its latencies count from then.

Placement: the client and the conductor sit with the first role of the
pipeline (prefill, or main_decode when colocated). Tokens and control
messages from another datacenter pay half the link's base RTT. The entry
role's model may carry a serving overhead (`FittedPerf.serving_overhead_ms`,
measured in the real app): each request enters its pipeline that much after it
arrives, for the conductor, Serve's routing and the token channel, which add
that to the real first token (and to every later one alike).

Pipelines (../shared/PDD.md, ../shared/DESIGN.md):
- colocated: main_decode prefills and decodes.
- pd_intra_dc (P-D): P prefills and streams the first token; relay_decode,
  routed then, pulls the blocks it lacks over the intra-DC link and decodes.
- pd_cross_dc_naive (P-D-naive): main_decode pulls the full prompt KV over
  the WAN (its own cache unused), computes the first token's KV and only then
  do tokens 1 and 2 reach the client.
- pdd: MD is routed first, then the pipeline chosen, then P routed.
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
    MD computes the rest and continues the stream). At its cap the relay's
    tokens stop reaching the client, but RLD's request keeps decoding
    (discarded) until the final step aborts it, as relay.py's pump does; the
    next round is then the final one. A request RLD finishes before any
    handoff ends there; MD's step in flight still completes and lands in its
    cache.
  - P-RLD (singular filter; WAN down; no main decoder alive): RLD decodes
    everything. Outages (`Outage`) set those facts for requests routed
    during them; a transfer cannot start on a down link until it is back.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from collections.abc import Callable, Iterable, Iterator

from app.config import Mode, PDDConfig, RoleName
from app.policy import (
    ClusterFacts,
    HandoffStep,
    LinkBacklog,
    LinkFacts,
    Pipeline,
    RequestFacts,
    blocks_missing,
    choose_pipeline,
    next_handoff_step,
    relay_cap,
    resolve_handoff_mode,
)
from app.sim.cluster import PerfArg, SimCluster, build_cluster, entry_role, model_spec
from app.sim.engine import WAITING, Instance, PrefillJob, Seq
from app.sim.events import Loop
from app.sim.jobs import Job, Session
from app.sim.outages import Outage, Outages
from app.sim.pending import PendingMDWork
from app.sim.results import Results
from app.sim.routing import KeyChain, KeyMaker, routing_index
from app.sim.workload import Request

P_MD, P_RLD_MD, P_RLD, P_D_NAIVE = Pipeline.p_md, Pipeline.p_rld_md, Pipeline.p_rld, Pipeline.p_d_naive


class Twin:
    """One simulation run of a config; `run(requests)` serves them all and returns Results."""

    def __init__(self, config: PDDConfig, perf: PerfArg = None, seed: int = 0,
                 progress: Callable[[int], None] | None = None, outages: Iterable[Outage] = ()):
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
        self.wan_backlog = LinkBacklog(self.wan.bw) if self.wan else None
        self.pending = PendingMDWork(self.loop, config.kv.transfer_timeout_s)
        entry = pools[entry_role(self.mode)][0]
        self.serving_overhead_s = getattr(entry.perf, "serving_overhead_ms", 0.0) / 1000
        self.outages = Outages(outages)
        if self.wan is not None:
            self.wan.down = self.outages.windows["wan"]
        self.replicas = {inst.name: inst for pool in pools.values() for inst in pool}
        self.candidates = {role: {inst.name: inst.kv_blocks for inst in pool} for role, pool in pools.items()}
        self.index = routing_index(self.block, {name: inst.kv_blocks for name, inst in self.replicas.items()})
        replicas = self.replicas
        self._load: Callable[[str], int] = lambda rid: replicas[rid].streams
        self.keymaker = KeyMaker(self.block)
        self._cluster_facts: dict[tuple[float, bool, bool, bool], ClusterFacts] = {}
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
        full = self.keymaker.turn(sess.conv, req.prefix_tokens, sess.stream)
        job = Job(self._rid, req, sess, len(sess.divs), full, self.block)
        self._rid += 1
        if self.serving_overhead_s:
            self.loop.at(self.loop.now + self.serving_overhead_s, self._start, job)
        else:
            self._start(job)

    def _start(self, job: Job) -> None:
        mode = self.mode
        if mode is Mode.pdd:
            self._pdd(job)
        elif mode is Mode.colocated:
            self._colocated(job)
        elif mode is Mode.pd_intra_dc:
            self._start_prefill(job, self._pd_first)
        else:
            self._start_prefill(job, self._naive_first)

    def _down(self, kind: str) -> bool:
        return self.outages.down(kind, self.loop.now)

    # ---- the conductor's index (Conductor.route / unroute / remember) ------------------

    def _route(self, role: RoleName, keys: KeyChain) -> tuple[Instance, int]:
        index = self.index
        choice = index.choose(self.candidates[role], keys, self._load)
        inst = self.replicas[choice.replica_id]
        # the next turn may arrive before this one ends: it should come here too
        index.route(inst.name, keys, inst.kv_blocks)
        return inst, choice.cached_tokens

    def _remember(self, inst: Instance, keys: KeyChain, job: Job, actual_hit: int | None) -> None:
        if actual_hit is not None:
            self.index.observe(inst.name, job.keys, actual_hit)
        self.index.record(inst.name, keys, inst.kv_blocks)

    def _settle(self, job: Job) -> None:
        """The finishing decoder's stream ends; what it now holds goes into the index."""
        d = job.d
        d.streams -= 1
        pipe = job.pipe
        if pipe is P_D_NAIVE:  # salted blocks serve no later request
            return
        # relay.py remembers MD without the engine's hit (the final request's prefix is MD's own extend steps)
        self._remember(d, job.full, job, None if pipe is P_RLD_MD else job.dl.hit)

    # ---- requests ---------------------------------------------------------------------

    def _finish(self, job: Job) -> None:
        if job.done:
            raise AssertionError(f"request {job.rid} finished twice")
        job.done = True
        req = job.req
        job.row = self.results.add(job.rid, req.arrival_s, job.t_first, job.t_last, job.gap, job.pipe, req.prompt_tokens,
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
        job.t_relay_last = t
        if job.req.output_tokens == 1:
            job.t_last = t
            return True
        return False

    def _prefill(self, job: Job, inst: Instance, need: int, cb: Callable[[PrefillJob], None]) -> None:
        prompt = job.req.prompt_tokens
        lease = job.pl
        hit = lease.hit if lease.hit < prompt else prompt - 1
        inst.submit_prefill(PrefillJob(job, prompt - hit, hit, need, lease, cb))

    def _start_prefill(self, job: Job, cb: Callable[[PrefillJob], None]) -> None:
        """Conductor.prefill: route P by prefix, P computes the prompt and its first token."""
        req = job.req
        p, _ = self._route(RoleName.prefill, job.keys)
        job.p = p
        p.streams += 1
        job.pl = p.open(req.session, req.prefix_tokens, job.sess.divs, job.gen)
        self._prefill(job, p, req.prompt_tokens, cb)

    def _prefilled(self, job: Job) -> None:
        """P's stream ended: its real hit corrects the index, which then records the prompt."""
        p = job.p
        p.streams -= 1
        p.publish(job.pl, job.req.prompt_tokens, job.gen)
        self._remember(p, job.keys, job, job.pl.hit)

    def _open_decoder(self, job: Job, inst: Instance, prefix_tokens: int) -> None:
        job.d = inst
        inst.streams += 1
        job.dl = inst.open(job.req.session, prefix_tokens, job.sess.divs, job.gen)

    def _decode(self, job: Job, inst: Instance, ctx: int, n: int, t_prev: float, off: float,
                cb: Callable[[Seq, float], None] | None = None) -> Seq:
        """Continue the stream on `inst` from `ctx` tokens; its tokens reach the client `off` later."""
        job.t_prev = t_prev
        job.off = off
        seq = Seq(job, ctx, n, ctx + n, job.dl, cb or self._decoded)
        inst.submit_decode(seq)
        return seq

    def _decoded(self, seq: Seq, worst: float) -> None:
        job: Job = seq.owner
        off = job.off
        job.gap = max(job.gap, seq.t_first + off - job.t_prev, worst)
        job.t_last = self.loop.now + off
        req = job.req
        seq.inst.close(seq.lease, req.prompt_tokens + req.output_tokens - 1, job.gen)
        self._settle(job)
        self._finish(job)

    def _send(self, link, job: Job, blocks: int, done: Callable[[Job], None]) -> None:
        nbytes = blocks * self.block_bytes
        if link.wan:
            job.wan += nbytes
            if job.done:
                self.results.add_wan(job.row, nbytes)
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
        d, _ = self._route(RoleName.main_decode, job.keys)
        self._open_decoder(job, d, req.prefix_tokens)
        job.pl = job.dl  # one engine: one lease
        self._prefill(job, d, req.prompt_tokens + req.output_tokens, self._colocated_first)

    def _colocated_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        now = self.loop.now
        req = job.req
        if self._first_token(job, now):
            job.d.close(job.dl, req.prompt_tokens, job.gen)
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, now, 0.0)

    # ---- classic PD ------------------------------------------------------------------

    def _pd_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        job.pipe = Pipeline.p_d
        self._prefilled(job)
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        d, _ = self._route(RoleName.relay_decode, job.keys)
        self._open_decoder(job, d, req.prefix_tokens)
        job.pulls = 1
        self._send(self.intra, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._pd_pulled)

    def _pd_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0)

    def _naive_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        job.pipe = P_D_NAIVE
        self._prefilled(job)
        if req.output_tokens == 1:
            self._first_token(job, self.loop.now)
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        d, _ = self._route(RoleName.main_decode, job.keys)
        self.index.unroute(d.name, job.keys)  # salted: the decoder's cache will not hold this prompt
        self._open_decoder(job, d, 0)  # the naive decoder skips its prefix cache
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
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + 2, req.output_tokens - 2, t, self.ow)

    # ---- PDD (app/relay.py) ----------------------------------------------------------

    def _pdd(self, job: Job) -> None:
        req = job.req
        md, md_cached = None, 0
        if not self._down("main_decode"):  # Conductor.route raises when no main decoder is alive
            md, md_cached = self._route(RoleName.main_decode, job.keys)
            # a previous turn's MD work still running there: count its blocks, wait for it
            job.after, covered = self.pending.covering(md.name, job.keys)
            md_cached = max(md_cached, covered * self.block)
        job.md = md
        # relay.rld_load: the least loaded relay decoder and its occupancy
        rld = min(self.R, key=self._streams) if self.R else None
        load = rld.streams / rld.max_seqs if rld is not None else 1.0
        key = (load, rld is not None, not self._down("wan"), md is not None)
        facts = self._cluster_facts.get(key)
        if facts is None:  # frozen, and few distinct values: built once each
            facts = self._cluster_facts[key] = ClusterFacts(self.block_bytes, self.block, self.wan_facts, *key)
        queued = self.wan_backlog.queued(self.loop.now)
        if queued:
            facts = replace(facts, wan_backlog_bytes=queued)
        decision = choose_pipeline(RequestFacts(req.prompt_tokens, req.output_tokens, md_cached), facts, self.routing)
        job.pipe = pipe = decision.pipeline
        job.wan_planned = decision.blocks_to_send * self.block_bytes
        if pipe is not P_MD:
            job.r = rld
            job.cap = relay_cap(self.handoff, load)
            job.hmode = resolve_handoff_mode(self.handoff, load)
        self._start_prefill(job, self._pdd_first)

    @staticmethod
    def _streams(inst: Instance) -> int:
        return inst.streams

    def _pdd_first(self, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        self._prefilled(job)
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        pipe = job.pipe
        prompt = req.prompt_tokens
        if pipe is P_RLD:
            if job.md is not None:  # singular, or WAN down: MD never sees this request
                self.index.unroute(job.md.name, job.keys)
            self._open_decoder(job, job.r, req.prefix_tokens)
            job.rl = job.dl
            job.pulls = 1
            self._send(self.intra, job, blocks_missing(prompt, job.rl.hit, self.block), self._singular_pulled)
            return
        if pipe is P_MD:
            job.pulls = 1
        else:
            r = job.r
            r.streams += 1
            job.rl = r.open(req.session, req.prefix_tokens, job.sess.divs, job.gen)
            job.pulls = 2
            self._send(self.intra, job, blocks_missing(prompt, job.rl.hit, self.block), self._relay_pulled)
            job.warm = self.pending.track(job.md.name, job.keys)
        self.pending.after(job.after, self._main_pull, job)

    def _main_pull(self, job: Job) -> None:
        """MD pulls what it lacks over the WAN (after the earlier turn's MD work it waited for)."""
        req = job.req
        self._open_decoder(job, job.md, req.prefix_tokens)
        if job.done:  # the relay finished the request while MD's pull waited
            self.results.set_decode_hit(job.row, job.dl.hit)
        self.wan_backlog.add(job.wan_planned, self.loop.now)
        self._send(self.wan, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._main_pulled)

    def _singular_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0)

    def _end_relay(self, job: Job, keep: int) -> None:
        """RLD's request is over (finished, or aborted at the handoff): its blocks stay cached."""
        job.r.streams -= 1
        job.r.close(job.rl, keep, job.gen)
        job.seq = None

    def _relay_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        if job.handed:  # MD took over before the relay could start: its request was aborted
            self._end_relay(job, req.prompt_tokens)
            return
        n = min(job.cap, req.output_tokens - 1)
        job.seq = self._relay_decode(job, req.prompt_tokens + 1, n, self._relay_stopped)

    def _relay_decode(self, job: Job, ctx: int, n: int, cb: Callable[[Seq, float], None]) -> Seq:
        seq = Seq(job, ctx, n, ctx + n, job.rl, cb)
        job.r.submit_decode(seq)
        return seq

    def _relay_stopped(self, seq: Seq, worst: float) -> None:
        """RLD produced the last token the client takes from it: the request's end, or the cap."""
        job: Job = seq.owner
        now = self.loop.now
        req = job.req
        job.gap = max(job.gap, seq.t_first - job.t_first, worst)
        job.relay_tokens = seq.n
        job.t_relay_last = now
        if seq.n == req.output_tokens - 1:  # RLD ended the request before the handoff
            self._end_relay(job, req.prompt_tokens + req.output_tokens - 1)
            job.catch_up = self.pending.track(job.md.name, job.full)  # MD catches up on the answer: the next turn waits for it
            job.t_last = now
            self._finish(job)
            return
        # at the cap: RLD's request goes on (its tokens discarded) until the final step aborts it
        job.capped = True
        job.seq = self._relay_decode(job, seq.ctx + seq.n, req.output_tokens - 1 - seq.n, self._discarded)

    def _discarded(self, seq: Seq, worst: float) -> None:
        """RLD finished the output past its cap before MD took over."""
        self._end_relay(seq.owner, seq.ctx + seq.n)

    def _main_pulled(self, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        if job.pipe is P_MD:  # MD's request decodes as soon as its pull lands
            self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, self.ow)
            return
        # the warm request: MD computes the first token's KV (its own sampled token is discarded)
        job.d.submit_prefill(PrefillJob(job, 1, req.prompt_tokens, req.prompt_tokens + 1, job.dl, self._md_step_done))

    def _md_step_done(self, pj: PrefillJob) -> None:
        self.loop.at(self.loop.now + self.ow, self._handoff, pj.owner)

    def _handoff(self, job: Job) -> None:
        """The conductor learns MD finished a step (the warm-up or a catch-up round)."""
        now = self.loop.now
        req = job.req
        md = job.d
        if job.warm is not None:  # the warm-up's blocks are MD's cache now
            md.publish(job.dl, req.prompt_tokens + 1, job.gen)
            self.pending.done(md.name, job.warm)
            job.warm = None
        if job.done:  # RLD finished the request: MD's steps only bring its cache along
            self.index.record(md.name, job.full.head((req.prompt_tokens + 1) // self.block), md.kv_blocks)
            behind = req.output_tokens - 1 - job.sent
            if behind > 0:  # relay.py: MD extends over the relay's tokens, in the background
                pj = PrefillJob(job, behind, req.prompt_tokens + 1 + job.sent, req.prompt_tokens + req.output_tokens, job.dl, self._md_caught_up)
                md.submit_prefill(pj)
                return
            md.streams -= 1
            md.close(job.dl, req.prompt_tokens + 1 + job.sent, job.gen)
            self.pending.done(md.name, job.catch_up)
            return
        md.streams -= 1
        seq = job.seq
        if job.capped:
            if seq is not None:
                produced, _, _ = job.r.abort(seq, now)
                self._end_relay(job, seq.ctx + produced)
            self._extend(job, job.relay_tokens, final=True)
            return
        if seq is None:  # the relay has not started: MD continues from the first token
            job.handed = True
            self._extend(job, 0, final=True)
            return
        produced, _ = job.r.tokens_by(seq, now)
        step = next_handoff_step(produced - job.sent, job.rounds, job.hmode, self.handoff)
        if step is HandoffStep.catch_up:
            job.rounds += 1
            self._extend(job, produced, final=False)
            return
        started = seq.state != WAITING
        produced, t_last, worst = job.r.abort(seq, now)
        if started and produced:
            job.gap = max(job.gap, worst, seq.t_first - job.t_first)
            job.t_relay_last = t_last
        job.relay_tokens = produced
        self._end_relay(job, req.prompt_tokens + 1 + produced)
        self._extend(job, produced, final=True)

    def _md_caught_up(self, pj: PrefillJob) -> None:
        """MD holds the whole turn the relay finished."""
        job: Job = pj.owner
        md, req = job.d, job.req
        md.streams -= 1
        md.close(job.dl, req.prompt_tokens + req.output_tokens, job.gen)
        self.index.record(md.name, job.full, md.kv_blocks)
        self.pending.done(md.name, job.catch_up)

    def _extend(self, job: Job, upto: int, final: bool) -> None:
        """A new MD request: prompt + the tokens the client has, of which MD computes the
        relay tokens it has not been sent yet in one extend step (at least one token).
        A catch-up request stops there; the final one decodes the rest."""
        req = job.req
        ctx = req.prompt_tokens + 1 + job.sent
        tokens = upto - job.sent
        job.sent = upto
        if final:
            need, cb = req.prompt_tokens + req.output_tokens, self._handed_over
        else:
            need, cb = req.prompt_tokens + 1 + upto, self._md_step_done
        job.d.streams += 1
        pj = PrefillJob(job, max(1, tokens), ctx, need, job.dl, cb)
        self.loop.at(self.loop.now + self.ow, _submit, (job.d, pj))

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
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + job.relay_tokens + 2, left, t, self.ow)


def _submit(arg: tuple[Instance, PrefillJob]) -> None:
    arg[0].submit_prefill(arg[1])
