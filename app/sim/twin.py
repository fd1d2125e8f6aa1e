"""The twin's conductor: every request through its mode's pipeline.

Decisions are the real conductor's, made by the same code on the facts the
twin holds: replicas by app/conductor/prefix_index.PrefixIndex (`choose` when routing,
`route` what was sent where, `unroute` what will not land after all, `observe`
the hit the engine reports and `record` what a replica now holds; keys are
synthesised per conversation by app/sim/routing.py), the pipeline by
`policy.choose_pipeline`, what crosses a link by `policy.blocks_missing`, the
relay and its handoff by `policy.RelayMachine`. The calls come in the
conductor's order (app/conductor/baselines.py, app/conductor/relay.py), and the load routing
compares is the conductor's: requests it has in flight on each replica
(`Instance.streams`). What is not a decision is physics: engines
(app/sim/engine.py) and links (app/sim/network.py).

A conversation's turns are sequential: a turn due while the previous one
still runs is sent when that one finishes (an agent waits for the answer),
and its latencies count from then.

Warm start (`warm_start=True`): a conversation whose first request in the run
repeats a prefix was under way before the run began. A cluster that had been
serving it would hold that prefix where routing sent its earlier turns, so it
is placed there before the request is dispatched: routed by the same
`PrefixIndex.choose`, stored in the replica's prefix cache and recorded in the
index, on the roles whose caches later turns reuse (prefill's, and the
decoder's: main decode's in PDD, colocated and pd_cross_dc, the PD decoder's in
pd_intra_dc; naive cross-DC PD's decoder skips its cache). Without it every
such conversation's context is recomputed and, in PDD, crosses the WAN at the
start of the run: a cold start, whose transient a measured window must avoid.

Placement: the client and the conductor sit with the first role of the
pipeline (prefill, or main_decode when colocated). Tokens and control
messages from another datacenter pay half the link's base RTT. The entry
role's model may carry a serving overhead (`FittedPerf.serving_overhead_ms`
and `serving_overhead_ms_per_in_flight`, measured in the real app): each
request enters its pipeline that much after it arrives, more for each other
request in flight then, for the conductor, Serve's routing and the token
channel, which add that to the real first token (and to every later one alike).
It may also carry the KV transport's cost per pull (`kv_pull_ms`,
`kv_pull_ms_per_mb`), which every link adds to its pulls (network.Link.set_transport),
and a decoder replica's own time on each request it gets after P's first token
(`decoder_request_overhead_ms`), which delays that request's pull or extend step.

Pipelines (docs/design.md; the baselines in app/sim/baselines.py):
- colocated: main_decode prefills and decodes.
- pd_intra_dc (P-D): P prefills and streams the first token; relay_decode,
  routed then, pulls the blocks it lacks over the intra-DC link and decodes.
- pd_cross_dc_naive (P-D-naive): main_decode pulls the full prompt KV over
  the WAN (its own cache unused), computes the first token's KV and only then
  do tokens 1 and 2 reach the client.
- pd_cross_dc (P-D-cross): the same, but main_decode is routed to the
  conversation's decoder and pulls only the blocks its prefix cache lacks.
- pdd: app/sim/pdd.py.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.config import Mode, PDDConfig, RoleName
from app.engine.kv.link import direction_name
from app.policy import ClusterFacts, LinkBacklog, LinkFacts, affinity_room
from app.sim.baselines import BaselinePipelines
from app.sim.cluster import PerfArg, SimCluster, build_cluster, entry_role, model_spec, role_config
from app.sim.engine import Instance
from app.sim.events import Loop
from app.sim.jobs import Gaps, Job, Session
from app.sim.network import Link, PullSlots
from app.sim.outages import Outage, Outages
from app.sim.pdd import P_D_CROSS, P_D_NAIVE, P_P_MD, P_RLD_MD
from app.sim.pending import PendingMDWork
from app.sim.results import Results
from app.sim.routing import KeyChain, KeyMaker, routing_index
from app.sim.work import PrefillJob, Seq
from app.sim.workload import Request

if TYPE_CHECKING:
    from app.sim.baselines import BaselineHost

WARM_ROLES = {
    Mode.colocated: (RoleName.main_decode,),
    Mode.pd_intra_dc: (RoleName.prefill, RoleName.relay_decode),
    Mode.pd_cross_dc_naive: (RoleName.prefill,),
    Mode.pd_cross_dc: (RoleName.prefill, RoleName.main_decode),
    Mode.pdd: (RoleName.prefill, RoleName.main_decode),
}
"""Roles whose prefix caches a conversation's later turns reuse, per mode (the warm start's)."""


class Twin(BaselinePipelines):
    """One simulation run of a config; `run(requests)` serves them all and returns Results."""

    def __init__(
        self,
        config: PDDConfig,
        perf: PerfArg = None,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        outages: Iterable[Outage] = (),
        warm_start: bool = False,
    ):
        self.config = config
        self.mode = config.mode
        self.loop = Loop()
        self.cluster: SimCluster = build_cluster(config, self.loop, self.mode, perf, seed)
        spec = model_spec(config)
        self.block = config.model.block_size
        self.window = config.model.max_model_len
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
        self.wan_facts = LinkFacts(self.wan.bw, self.wan.model.config.rtt_ms / 1000) if self.wan else None
        self.wan_backlog = LinkBacklog(self.wan.bw) if self.wan else None
        # the conductor's gap model (relay.pdd_pipeline), by the WAN's name and MD replicas'
        self.gaps = Gaps(direction_name(client, dc[RoleName.main_decode]), [inst.name for inst in self.M], self.ow) if self.wan else None
        self.pending = PendingMDWork(self.loop, config.kv.transfer_timeout_s)
        entry = pools[entry_role(self.mode)][0]
        self.serving_overhead_s = getattr(entry.perf, "serving_overhead_ms", 0.0) / 1000
        self.overhead_per_in_flight_s = getattr(entry.perf, "serving_overhead_ms_per_in_flight", 0.0) / 1000
        self.decoder_overhead_s = getattr(entry.perf, "decoder_request_overhead_ms", 0.0) / 1000
        pull_s, pull_s_per_byte = getattr(entry.perf, "kv_pull_ms", 0.0) / 1000, getattr(entry.perf, "kv_pull_ms_per_mb", 0.0) / 1e9
        for link in self.cluster.links.values():
            link.set_transport(pull_s, pull_s_per_byte)
        self.outages = Outages(outages)
        if self.wan is not None:
            self.wan.down = self.outages.windows["wan"]
        self.replicas = {inst.name: inst for pool in pools.values() for inst in pool}
        self.pulls = {name: PullSlots(self.loop, config.kv.concurrent_pulls, config.kv.pull_order) for name in self.replicas}
        self.candidates = {role: {inst.name: inst.kv_blocks for inst in pool} for role, pool in pools.items()}
        self.rooms = {role: affinity_room(role_config(config, role).engine) for role in pools}
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
        self.warm_roles = tuple(role for role in WARM_ROLES[self.mode] if pools.get(role)) if warm_start else ()

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
        if req.prompt_tokens + req.output_tokens > self.window:  # the real API refuses it
            raise ValueError(
                f"request of session {req.session!r} arriving at {req.arrival_s:g} s: prompt_tokens + output_tokens "
                f"({req.prompt_tokens} + {req.output_tokens}) exceed the model's window (model.max_model_len {self.window})"
            )
        self.results.arrivals_end_s = req.arrival_s  # arrivals come in order: the last one stays
        nxt = next(self._arrivals, None)
        if nxt is not None:
            self.loop.at(nxt.arrival_s, self._arrive, nxt)
        sess = self.sessions.get(req.session)
        if sess is None:
            sess = self.sessions[req.session] = Session()
            if self.warm_roles and req.prefix_tokens >= self.block:
                self._warm(req, sess)
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
        overhead = self.serving_overhead_s + self.overhead_per_in_flight_s * (self._rid - self.finished)
        self._rid += 1
        if overhead:
            self.loop.at(self.loop.now + overhead, self._start, job)
        else:
            self._start(job)

    @cython.locals(job=Job)
    def _start(self, job: Job) -> None:
        mode = self.mode
        if mode is Mode.pdd:
            self._pdd(job)
        elif mode is Mode.colocated:
            self._colocated(job)
        elif mode is Mode.pd_intra_dc:
            self._start_prefill(job, self._pd_first)
        elif mode is Mode.pd_cross_dc:
            self._start_prefill(job, self._cross_first)
        else:
            self._start_prefill(job, self._naive_first)

    def _warm(self, req: Request, sess: Session) -> None:
        """Place the prefix of a conversation under way before the run where routing puts it."""
        sess.stream = req.prefix_tokens
        keys = self.keymaker.turn(sess.conv, 0, req.prefix_tokens)
        for role in self.warm_roles:
            inst, _ = self._route(role, keys)
            inst.cache.put(req.session, req.prefix_tokens, 0)
            self.index.record(inst.name, keys, inst.kv_blocks)

    def _down(self, kind: str) -> bool:
        return self.outages.down(kind, self.loop.now)

    # ---- the conductor's index (Placement.route / unroute / remember) ------------------

    def _route(self, role: RoleName, keys: KeyChain) -> tuple[Instance, int]:
        index = self.index
        choice = index.choose(self.candidates[role], keys, self._load, self.rooms[role])
        inst = self.replicas[choice.replica_id]
        # the next turn may arrive before this one ends: it should come here too
        index.route(inst.name, keys, inst.kv_blocks)
        return inst, choice.cached_tokens

    def _remember(self, inst: Instance, keys: KeyChain, job: Job, actual_hit: int | None) -> None:
        if actual_hit is not None:
            self.index.observe(inst.name, job.keys, actual_hit)
        self.index.record(inst.name, keys, inst.kv_blocks)

    @cython.locals(job=Job)
    def _settle(self, job: Job) -> None:
        """The finishing decoder's stream ends; what it now holds goes into the index."""
        d = job.d
        assert d is not None and job.dl is not None  # the decoder that finished it
        d.streams -= 1
        pipe = job.pipe
        if pipe is P_D_NAIVE:  # salted blocks serve no later request
            return
        # relay.py remembers MD without the engine's hit (the final request's prefix is MD's own extend steps)
        self._remember(d, job.full, job, None if pipe is P_RLD_MD or pipe is P_P_MD else job.dl.hit)

    # ---- requests ---------------------------------------------------------------------

    @cython.locals(job=Job)
    def _finish(self, job: Job) -> None:
        if job.done:
            raise AssertionError(f"request {job.rid} finished twice")
        job.done = True
        req = job.req
        job.row = self.results.add(
            job.rid,
            req.arrival_s,
            job.t_first,
            job.t_last,
            job.gap,
            job.pipe,
            req.prompt_tokens,
            req.output_tokens,
            job.pl.hit if job.pl else 0,
            job.dl.hit if job.dl else 0,
            job.relay_tokens,
            job.wan,
        )
        self.finished += 1
        if self.progress is not None and not self.finished & 0xFFF:
            self.progress(self.finished)
        sess = job.sess
        sess.busy = False
        if sess.waiting:
            self._dispatch(sess.waiting.pop(0)._replace(arrival_s=self.loop.now), sess)

    @cython.locals(job=Job)
    def _first_token(self, job: Job, t: float) -> bool:
        """Record the first token; True when it was also the last."""
        job.t_first = t
        job.t_relay_last = t
        if job.req.output_tokens == 1:
            job.t_last = t
            return True
        return False

    @cython.locals(job=Job)
    def _prefill(self, job: Job, inst: Instance, need: int, cb: Callable[[PrefillJob], None]) -> None:
        prompt = job.req.prompt_tokens
        lease = job.pl
        assert lease is not None  # opened with the prefill's instance
        hit = lease.hit if lease.hit < prompt else prompt - 1
        inst.submit_prefill(PrefillJob(job, prompt - hit, hit, need, lease, cb))

    @cython.locals(job=Job)
    def _start_prefill(self, job: Job, cb: Callable[[PrefillJob], None]) -> None:
        """EngineOps.prefill: route P by prefix, P computes the prompt and its first token."""
        req = job.req
        p, _ = self._route(RoleName.prefill, job.keys)
        job.p = p
        p.streams += 1
        job.pl = p.open(req.session, req.prefix_tokens, job.sess.divs, job.gen)
        self._prefill(job, p, req.prompt_tokens, cb)

    @cython.locals(job=Job)
    def _prefilled(self, job: Job) -> None:
        """P's stream ended: its real hit corrects the index, which then records the prompt."""
        p = job.p
        assert p is not None and job.pl is not None  # P prefilled it
        p.streams -= 1
        p.publish(job.pl, job.req.prompt_tokens, job.gen)
        self._remember(p, job.keys, job, job.pl.hit)

    @cython.locals(job=Job)
    def _open_decoder(self, job: Job, inst: Instance, prefix_tokens: int) -> None:
        job.d = inst
        inst.streams += 1
        job.dl = inst.open(job.req.session, prefix_tokens, job.sess.divs, job.gen)

    @cython.locals(job=Job)
    def _decode(
        self, job: Job, inst: Instance, ctx: int, n: int, t_prev: float, off: float, cb: Callable[[Seq, float], None] | None = None, pulled: bool = False
    ) -> Seq:
        """Continue the stream on `inst` from `ctx` tokens; its tokens reach the client `off` later.
        `pulled`: `inst` pulled the prompt's KV, so its first step prefills the last token."""
        job.t_prev = t_prev
        job.off = off
        assert job.dl is not None  # its decoder's lease (_open_decoder)
        seq = Seq(job, ctx, n, ctx + n, job.dl, cb or self._decoded, pulled)
        inst.submit_decode(seq)
        return seq

    @cython.locals(seq=Seq, job=Job)
    def _decoded(self, seq: Seq, worst: float) -> None:
        job: Job = seq.owner
        off = job.off
        job.gap = max(job.gap, seq.t_first + off - job.t_prev, worst)
        job.t_last = self.loop.now + off
        req = job.req
        seq.inst.close(seq.lease, req.prompt_tokens + req.output_tokens - 1, job.gen)
        self._settle(job)
        self._finish(job)

    def _send(self, link: Link, to: Instance, job: Job, blocks: int, done: Callable[[Job], None]) -> None:
        """Decoder `to` pulls `blocks` of P's KV over `link`, in turn with its other pulls."""
        nbytes = blocks * self.block_bytes
        if link.wan:
            job.wan += nbytes
            if job.done:
                self.results.add_wan(job.row, nbytes)
        # a cross-DC PD decoder's replica is on the first token's way: the serving overhead counts it
        on_first_token = job.pipe is P_D_NAIVE or job.pipe is P_D_CROSS
        self.pulls[to.name].pull(link, nbytes, done, job, 0.0 if on_first_token else self.decoder_overhead_s)

    @cython.locals(job=Job)
    def _pull_done(self, job: Job) -> None:
        """One consumer has P's KV; P's blocks are free (cached) once all have."""
        job.pulls -= 1
        if job.pulls == 0:
            assert job.p is not None and job.pl is not None  # P prefilled it
            job.p.close(job.pl, job.req.prompt_tokens, job.gen)


if TYPE_CHECKING:

    def _hosts_the_pipelines(twin: Twin) -> BaselineHost:
        return twin  # the pipelines' methods (app/sim/pdd.py, baselines.py) take Twin for the host they describe
