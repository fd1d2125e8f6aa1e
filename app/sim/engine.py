"""One simulated engine replica: continuous batching with chunked prefill.

Like vLLM's scheduler, each step runs one token for every running sequence
(decode batch up to `max_num_seqs`) and fills the rest of the step's token
budget (`max_num_batched_tokens`) with prefill chunks, first come first served.
New work joins at the next step boundary.

While no prefill is queued the replica runs a decode-only stretch ("epoch")
without one event per step: step times follow `DecodeRamp`, and the epoch ends
at the next sequence completion, or earlier, at the first step boundary after
new work arrives (a cut). Memory (leases) and CPU sharing (hosts): app/sim/work.py.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from itertools import count

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.sim.cache import PrefixCache, usable_tokens
from app.sim.events import Loop
from app.sim.perf import DecodeRamp, PerfModel
from app.sim.work import DONE, RUNNING, WAITING, Host, Lease, PrefillJob, Seq, StepLog

IDLE, STEP, EPOCH, ENDING = 0, 1, 2, 3


class Instance:
    def __init__(self, loop: Loop, name: str, perf: PerfModel, *, max_seqs: int, max_batched: int, capacity: int, block_size: int):
        self.loop = loop
        self.name = name
        self.perf = perf
        self.max_seqs = max_seqs
        self.max_batched = max_batched
        self.capacity = capacity
        self.block = block_size
        self.cache = PrefixCache(capacity, block_size)
        self.kv_blocks = capacity // block_size
        """KV capacity in blocks: what the conductor's index is told (`num_kv_blocks`)."""
        self.reserved = 0
        self.active = 0
        """Open leases."""
        self.streams = 0
        """Requests the conductor has in flight here: its routing load (EngineClient.load)."""
        self.state = IDLE
        self.prefill_q: deque[PrefillJob] = deque()
        self.admitted_prefills = 0
        self.join_q: deque[Seq] = deque()
        self.n = 0
        self.kv = 0.0
        """Context tokens of the running sequences."""
        self.steps = 0
        self.fin_heap: list[tuple[int, int, Seq]] = []
        self._order = count()
        self.removals: list[Seq] = []
        self.steplog = StepLog()
        self.version = 0
        self.t0 = 0.0
        self.s0 = 0
        self.m = 0
        self.ramp: DecodeRamp | None = None
        self.step_dt = 0.0
        self.chunks: list[tuple[PrefillJob, int]] = []
        self.cut = False
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.host: Host | None = None
        self.neighbor_slowdown = getattr(perf, "neighbor_slowdown", 0.0)
        # a model that prices a one-token chunk after a prefix as a decode token (the roofline)
        # lets a pulled sequence's first step stay in a decode stretch
        self.pulled_first_step = perf.step_s(1, 0, 1.0, 1.0, 1) != perf.step_s(0, 1, 1.0, 1.0, 0)
        self.busy = False
        """Counted busy on the host (state changes inside a step boundary do not count)."""
        self.slow = 1.0
        """The host's slowdown of the step or epoch in flight."""
        self.step_joined: Sequence[Seq] = ()

    # ---- leases and the prefix cache ----------------------------------------------

    def open(self, key: Hashable, prefix_tokens: int, divergences: Sequence[int], gen: int) -> Lease:
        """Claim the conversation's cached prefix for a request of generation `gen`
        (its blocks stop being evictable)."""
        entry = self.cache.pin(key)
        hit = 0 if entry is None else usable_tokens(entry[0], entry[1], prefix_tokens, divergences, gen)
        self.active += 1
        return Lease(key, hit - hit % self.block, entry is not None, divergences)

    @cython.locals(lease=Lease)
    def publish(self, lease: Lease, tokens: int, gen: int) -> None:
        """The request's first `tokens` are computed: later turns of the conversation
        can reuse them while this request still runs (its reservation becomes cache)."""
        moved = min(lease.held, max(0, tokens - tokens % self.block - lease.hit))
        self.reserved -= moved
        lease.held -= moved
        self.cache.publish(lease.key, tokens, gen, lease.pinned, lease.divergences)
        lease.pinned = True

    @cython.locals(lease=Lease)
    def close(self, lease: Lease, keep_tokens: int, gen: int) -> None:
        """The request is done here: its blocks become the conversation's cached prefix."""
        self.reserved -= lease.held
        lease.held = 0
        self.active -= 1
        self.cache.set_limit(self.capacity - self.reserved)
        self.cache.release(lease.key, keep_tokens, gen, lease.pinned, lease.divergences)
        lease.pinned = False
        if self.prefill_q or self.join_q:  # freed memory may admit queued work
            self._poke()

    @cython.locals(lease=Lease)
    def _reserve(self, lease: Lease, need: int) -> bool:
        """Reserve memory for the tokens a request will write beyond its cached prefix."""
        extra = need - lease.hit - lease.held
        if extra > 0:
            if self.cache.held + self.reserved + extra > self.capacity and (self.n or self.admitted_prefills):
                return False
            self.reserved += extra
            lease.held += extra
            self.cache.set_limit(self.capacity - self.reserved)
        return True

    # ---- work in ------------------------------------------------------------------

    def submit_prefill(self, job: PrefillJob) -> None:
        self.prefill_q.append(job)
        self._poke()

    def submit_decode(self, seq: Seq) -> None:
        if seq.n < 1:
            raise ValueError("a decode sequence must produce at least one token")
        seq.inst = self
        self.join_q.append(seq)
        self._poke()

    @cython.locals(seq=Seq)
    def tokens_by(self, seq: Seq, t: float) -> tuple[int, float]:
        """(tokens `seq` produced here by time t, time of the last of them; -1 if none)."""
        if seq.state == WAITING:
            return 0, -1.0
        if seq.state == DONE:
            return seq.n, -1.0
        state = self.state
        ramp = self.ramp
        if state == EPOCH:
            assert ramp is not None  # an epoch runs on its ramp
            k = ramp.steps_within(t - self.t0)
            idx = self.s0 + (k if k < self.m else self.m)
        else:
            idx = self.steps
        if idx > seq.fin:
            idx = seq.fin
        produced = idx - seq.join
        if produced <= 0:
            return 0, -1.0
        if state == EPOCH:
            assert ramp is not None
            return produced, self.t0 + ramp.cum(idx - self.s0)
        # a step in flight started at the last boundary; between steps, the boundary is now
        return produced, self.t0 if state == STEP else self.loop.now

    def abort(self, seq: Seq, t: float) -> tuple[int, float, float]:
        """Stop `seq` at time t (its in-flight token is dropped).

        Returns (tokens produced, time of the last one or -1, worst step so far).
        """
        if seq.state != RUNNING:
            produced = 0 if seq.state == WAITING else seq.n
            seq.state = DONE
            return produced, -1.0, 0.0
        produced, t_last = self.tokens_by(seq, t)
        worst = self.steplog.worst_since(seq.log0)
        seq.n = produced
        self.removals.append(seq)
        self._poke()
        return produced, t_last, worst

    # ---- stepping -------------------------------------------------------------------

    def _poke(self) -> None:
        state = self.state
        if state == IDLE:
            self._plan(self.loop.now)
        elif state == EPOCH and not self.cut:
            self._cut(self.loop.now)

    def _cut(self, now: float) -> None:
        """New work waits for the next step boundary: end the epoch there (when it can start then)."""
        if (not self.prefill_q or self.n >= self.max_batched) and (not self.join_q or self.n >= self.max_seqs):
            return
        self.cut = True
        ramp = self.ramp
        assert ramp is not None  # only an epoch is cut
        k = ramp.steps_within(now - self.t0) + 1
        if k < self.m:
            self.m = k
            self.version += 1
            self.loop.at(self.t0 + ramp.cum(k), self._epoch_end, self.version)

    @cython.locals(seq=Seq)
    def _admit_joins(self) -> list[Seq]:
        joined = []
        q = self.join_q
        while q:
            seq = q[0]
            if seq.state == DONE:
                q.popleft()
                continue
            if self.n >= self.max_seqs or not self._reserve(seq.lease, seq.need):
                break
            q.popleft()
            seq.state = RUNNING
            seq.join = self.steps
            seq.fin = self.steps + seq.n
            seq.log0 = self.steplog.n
            self.n += 1
            self.kv += seq.ctx
            heapq.heappush(self.fin_heap, (seq.fin, next(self._order), seq))
            joined.append(seq)
        return joined

    @cython.locals(job=PrefillJob, seq=Seq)
    def _plan(self, now: float) -> None:
        joined = self._admit_joins() if self.join_q else ()
        first_prefills = 0
        if joined and self.pulled_first_step:
            for seq in joined:
                if seq.prefills_first:
                    first_prefills += 1
        budget = self.max_batched - self.n
        chunks = []
        if self.prefill_q and budget > 0:
            for job in self.prefill_q:
                if not job.admitted:
                    if not self._reserve(job.lease, job.need):
                        break
                    job.admitted = True
                    self.admitted_prefills += 1
                c = job.left if job.left < budget else budget
                chunks.append((job, c))
                budget -= c
                if budget <= 0:
                    break
        self.t0 = now
        if chunks or first_prefills:
            # a sequence's one-token chunk attends to its context as its decode token would
            pf = first_prefills
            kv = self.kv
            pairs = self.kv
            after_prefix = first_prefills
            for job, c in chunks:
                pf += c
                kv += job.ctx + c
                pairs += c * job.ctx + c * (c + 1) / 2  # perf.chunk_attention_pairs, inlined
                if job.ctx:
                    after_prefix += 1
            dt = self.perf.step_s(pf, self.n - first_prefills, kv, pairs, after_prefix)
            if self.host is not None:
                self.slow = self._slowdown()
                dt *= self.slow
                self.step_joined = joined
            self.state = STEP
            self.chunks = chunks
            self.step_dt = dt
            for seq in joined:
                seq.t_first = now + dt
            self.version += 1
            loop = self.loop
            heapq.heappush(loop.heap, (now + dt, next(loop.order), self._step_end, self.version))
        elif self.n:
            heap = self.fin_heap
            while heap[0][2].state != RUNNING:
                heapq.heappop(heap)
            lines = self.perf.decode_lines(self.n, self.kv)
            if self.host is not None:
                slow = self.slow = self._slowdown()
                lines = (lines[0] * slow, lines[1] * slow, lines[2] * slow, lines[3] * slow)
            ramp = self.ramp = DecodeRamp(lines)
            steps = self.steps
            m = self.m = heap[0][0] - steps
            self.s0 = steps
            self.state = EPOCH
            self.cut = False
            if joined:
                first = now + ramp.step(0)
                for seq in joined:
                    seq.t_first = first
            self.version += 1
            loop = self.loop
            heapq.heappush(loop.heap, (now + ramp.cum(m), next(loop.order), self._epoch_end, self.version))
        else:
            self.state = IDLE
        if self.host is not None and (self.state != IDLE) != self.busy:
            self.busy = not self.busy
            self.host.busy += 1 if self.busy else -1
            self.host.changed(self, now)

    def _slowdown(self) -> float:
        assert self.host is not None  # only a replica sharing a host slows down
        return 1.0 + self.neighbor_slowdown * (self.host.busy - self.busy)

    def _rescale(self, now: float) -> None:
        """The host's other busy replicas changed in number: a step in flight runs its
        remaining share at the new rate; an epoch ends at its next step boundary."""
        if self.state != STEP and self.state != EPOCH:
            return
        slow = self._slowdown()
        if slow == self.slow:
            return
        if self.state == STEP:
            end = self.t0 + self.step_dt
            left = (end - now) * slow / self.slow
            self.slow = slow
            self.step_dt = now - self.t0 + left
            for seq in self.step_joined:
                seq.t_first = now + left
            self.version += 1
            self.loop.at(now + left, self._step_end, self.version)
        else:
            ramp = self.ramp
            assert ramp is not None  # an epoch runs on its ramp
            k = ramp.steps_within(now - self.t0) + 1
            if k < self.m:
                self.m = k
                self.version += 1
                self.loop.at(self.t0 + ramp.cum(k), self._epoch_end, self.version)

    @cython.locals(job=PrefillJob)
    def _step_end(self, version: int) -> None:
        if version != self.version:
            return
        now = self.loop.now
        self.state = ENDING
        dt = self.step_dt
        self.busy_s += dt
        self.steps += 1
        self.decode_tokens += self.n
        self.kv += self.n
        self._note(dt)
        done = []
        q = self.prefill_q
        for job, c in self.chunks:
            job.left -= c
            job.ctx += c
            self.prefill_tokens += c
            if job.left == 0:
                q.popleft()  # chunks are taken from the queue's head, in order
                self.admitted_prefills -= 1
                done.append(job)
        self.chunks = []
        self._boundary(now)
        for job in done:
            job.cb(job)
        self.state = IDLE
        self._plan(now)

    def _epoch_end(self, version: int) -> None:
        if version != self.version:
            return
        now = self.loop.now
        self.state = ENDING
        m = self.m
        n = self.n
        self.busy_s += now - self.t0
        self.steps += m
        self.decode_tokens += m * n
        self.kv += m * n
        assert self.ramp is not None  # an epoch runs on its ramp
        self._note(self.ramp.step(m - 1))  # steps only grow within an epoch
        self._boundary(now)
        self.state = IDLE
        self._plan(now)

    @cython.locals(seq=Seq)
    def _boundary(self, now: float) -> None:
        steps = self.steps
        if self.removals:
            for seq in self.removals:
                if seq.state == RUNNING:
                    seq.state = DONE
                    self.n -= 1
                    self.kv -= seq.ctx + (steps - seq.join)
            self.removals.clear()
        heap = self.fin_heap
        while heap and heap[0][0] <= steps:
            seq = heapq.heappop(heap)[2]
            if seq.state != RUNNING:
                continue
            seq.state = DONE
            self.n -= 1
            self.kv -= seq.ctx + (steps - seq.join)
            seq.cb(seq, self.steplog.worst_since(seq.log0))

    def _note(self, dt: float) -> None:
        if self.steplog.note(dt):
            self.steplog.forget_before(min((s.log0 for _, _, s in self.fin_heap if s.state == RUNNING), default=self.steplog.n))
