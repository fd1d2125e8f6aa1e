"""The twin's baseline pipelines (app/conductor/baselines.py): colocated, classic PD, and
cross-datacenter PD with and without the decoder's prefix cache (pd_cross_dc, naive). A part of `Twin` (app/sim/twin.py), which holds the state and
the steps every mode shares; the PDD pipelines are the part below it (app/sim/pdd.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.config import RoleName
from app.policy import Pipeline, blocks_missing
from app.sim.jobs import Job
from app.sim.pdd import P_D_CROSS, P_D_NAIVE, PDDPipelines
from app.sim.work import PrefillJob

if TYPE_CHECKING:
    from typing import Protocol

    from app.sim.pdd import PipelineHost

    class BaselineHost(PipelineHost, Protocol):
        """PipelineHost (app/sim/pdd.py) with the baselines' own methods. Type checkers only."""

        def _colocated_first(self, pj: PrefillJob) -> None: ...
        def _pd_pulled(self, job: Job) -> None: ...
        def _cross_dc_first(self, pj: PrefillJob, decoder_cache: bool) -> None: ...
        def _naive_pulled(self, job: Job) -> None: ...
        def _naive_second(self, pj: PrefillJob) -> None: ...


class BaselinePipelines(PDDPipelines):
    """Twin's methods for the baseline modes: each starts a request or follows its events."""

    # ---- colocated -------------------------------------------------------------------

    @cython.locals(job=Job)
    def _colocated(self: BaselineHost, job: Job) -> None:
        job.pipe = Pipeline.colocated
        req = job.req
        d, _ = self._route(RoleName.main_decode, job.keys)
        self._open_decoder(job, d, req.prefix_tokens)
        job.pl = job.dl  # one engine: one lease
        self._prefill(job, d, req.prompt_tokens + req.output_tokens, self._colocated_first)

    @cython.locals(pj=PrefillJob, job=Job)
    def _colocated_first(self: BaselineHost, pj: PrefillJob) -> None:
        job: Job = pj.owner
        now = self.loop.now
        req = job.req
        assert job.d is not None and job.dl is not None  # the engine that prefilled it (_colocated)
        if self._first_token(job, now):
            job.d.close(job.dl, req.prompt_tokens, job.gen)
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, now, 0.0)

    # ---- classic PD ------------------------------------------------------------------

    @cython.locals(pj=PrefillJob, job=Job)
    def _pd_first(self: BaselineHost, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        job.pipe = Pipeline.p_d
        self._prefilled(job)
        assert job.p is not None and job.pl is not None  # P prefilled it
        if self._first_token(job, self.loop.now):
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        d, _ = self._route(RoleName.relay_decode, job.keys)
        self._open_decoder(job, d, req.prefix_tokens)
        assert job.dl is not None and self.intra is not None  # _open_decoder's lease; pd_intra_dc's link to the decoder
        job.pulls = 1
        self._send(self.intra, d, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._pd_pulled)

    @cython.locals(job=Job)
    def _pd_pulled(self: BaselineHost, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        assert job.d is not None  # the decoder (_pd_first)
        self._decode(job, job.d, req.prompt_tokens + 1, req.output_tokens - 1, job.t_first, 0.0, pulled=True)

    @cython.locals(pj=PrefillJob)
    def _naive_first(self: BaselineHost, pj: PrefillJob) -> None:
        self._cross_dc_first(pj, False)

    @cython.locals(pj=PrefillJob)
    def _cross_first(self: BaselineHost, pj: PrefillJob) -> None:
        self._cross_dc_first(pj, True)

    @cython.locals(pj=PrefillJob, job=Job, decoder_cache=cython.bint)
    def _cross_dc_first(self: BaselineHost, pj: PrefillJob, decoder_cache: bool) -> None:
        """P's first token, then main_decode pulls over the WAN: the blocks its prefix
        cache lacks (pd_cross_dc), or all of them, its cache salted out (naive)."""
        job: Job = pj.owner
        req = job.req
        job.pipe = P_D_CROSS if decoder_cache else P_D_NAIVE
        self._prefilled(job)
        assert job.p is not None and job.pl is not None  # P prefilled it
        if req.output_tokens == 1:
            self._first_token(job, self.loop.now)
            job.p.close(job.pl, req.prompt_tokens, job.gen)
            self._finish(job)
            return
        d, _ = self._route(RoleName.main_decode, job.keys)
        if not decoder_cache:
            self.index.unroute(d.name, job.keys)  # salted: the decoder's cache will not hold this prompt
        self._open_decoder(job, d, req.prefix_tokens if decoder_cache else 0)
        assert job.dl is not None and self.wan is not None  # _open_decoder's lease; the link to the decoder
        job.pulls = 1
        self._send(self.wan, d, job, blocks_missing(req.prompt_tokens, job.dl.hit, self.block), self._naive_pulled)

    @cython.locals(job=Job)
    def _naive_pulled(self: BaselineHost, job: Job) -> None:
        self._pull_done(job)
        req = job.req
        # the decoder computes the first token's KV, producing token 2: both reach the client then
        assert job.d is not None and job.dl is not None  # the decoder (_cross_dc_first)
        job.d.submit_prefill(PrefillJob(job, 1, req.prompt_tokens, req.prompt_tokens + req.output_tokens, job.dl, self._naive_second))

    @cython.locals(pj=PrefillJob, job=Job)
    def _naive_second(self: BaselineHost, pj: PrefillJob) -> None:
        job: Job = pj.owner
        req = job.req
        t = self.loop.now + self.ow
        job.t_first = t
        assert job.d is not None and job.dl is not None  # the decoder (_cross_dc_first)
        if req.output_tokens <= 2:
            job.t_last = t
            job.d.close(job.dl, req.prompt_tokens + req.output_tokens - 1, job.gen)
            self._settle(job)
            self._finish(job)
            return
        self._decode(job, job.d, req.prompt_tokens + 2, req.output_tokens - 2, t, self.ow)
