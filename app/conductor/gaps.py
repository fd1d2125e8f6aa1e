"""Routing's model of the gap a P-MD turn causes: MD's side of it, and its correction.

`choose_pipeline` predicts the gap from P's first token to MD's as the WAN pull, MD's
wait (`policy.decoder_wait_ms`) and its token's way back, plus a correction that
finished turns teach (`policy.GapCorrection`). This module keeps what those need between requests: each
decoder replica's recent step time, read from the tokens its streams deliver, and the
corrections, keyed by link and MD replica.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from app.conductor.generation import Tokens
from app.conductor.journal import Journey
from app.config import RoleName
from app.policy import GapCorrection, RouteDecision, decoder_wait_ms

#: Weight of each new interval in a replica's step time: about the last ten streams' steps.
STEP_WEIGHT = 0.1


class StepTimes:
    """Each decoder replica's recent time per decode step, in ms.

    The interval between two of a stream's token deltas, over the tokens the later one
    carries, is one step of that replica's batch as it ran then (a delta that waited in
    the token channel carries several). A replica no stream has shown yet counts 0: its
    wait is then learned by the correction."""

    def __init__(self, weight: float = STEP_WEIGHT):
        self.weight = weight
        self._ms: dict[str, float] = {}

    def note(self, replica_id: str, interval_s: float, tokens: int) -> None:
        if tokens <= 0:
            return
        step = interval_s * 1000 / tokens
        old = self._ms.get(replica_id)
        self._ms[replica_id] = step if old is None else old + self.weight * (step - old)

    def step_ms(self, replica_id: str) -> float:
        return self._ms.get(replica_id, 0.0)


class GapModel:
    """What routing needs for MD's side of a predicted gap, and what a finished turn teaches it."""

    def __init__(self) -> None:
        self.steps = StepTimes()
        self.correction = GapCorrection()

    @staticmethod
    def key(link: str, md_replica: str) -> str:
        return f"{link}|{md_replica}"

    def md_wait_ms(self, md_replica: str, running: int, batch_limit: int) -> float:
        return decoder_wait_ms(self.steps.step_ms(md_replica), running, batch_limit)

    def md_side(self, link: str, md_replica: str, running: int, batch_limit: int) -> tuple[float, float]:
        """MD's wait and the correction, as `ClusterFacts` takes them."""
        return self.md_wait_ms(md_replica, running, batch_limit), self.correction.value(self.key(link, md_replica), time.monotonic())

    def observe(self, link: str, md_replica: str, uncorrected_ms: float, actual_ms: float) -> None:
        """A P-MD turn's gap as seen, against routing's prediction for it before correction."""
        self.correction.observe(self.key(link, md_replica), uncorrected_ms, actual_ms, time.monotonic())

    async def timed(
        self, stream: AsyncGenerator[Tokens, None], journey: Journey, first_sent: float, link: str, md_replica: str, uncorrected_ms: float
    ) -> AsyncGenerator[Tokens, None]:
        """A P-MD turn's tokens after P's first (sent at `first_sent`): the time to MD's first is
        the turn's gap (`Journey.md_gap_ms`), which corrects the next predictions for this link and MD."""
        async with aclosing(stream):
            async for batch in stream:
                if journey.md_gap_ms is None and batch.token_ids and batch.role is RoleName.main_decode:
                    journey.md_gap_ms = (time.monotonic() - first_sent) * 1000
                    self.observe(link, md_replica, uncorrected_ms, journey.md_gap_ms)
                yield batch


def note_decision(journey: Journey, decision: RouteDecision, md_wait_ms: float, correction_ms: float, link: str, rld_load: float) -> None:
    """The route and what it was decided on, in the journey."""
    journey.pipeline = decision.pipeline.value
    journey.decision = {
        "reason": decision.reason,
        "md_hit_estimate": round(decision.md_hit_rate, 4),
        "blocks_to_send": decision.blocks_to_send,
        "expected_wan_ms": round(decision.expected_wan_ms, 1),
        "md_wait_ms": round(md_wait_ms, 1),
        "gap_correction_ms": round(correction_ms, 1),
        "predicted_gap_ms": round(decision.predicted_gap_ms, 1),
        "link": link,
        "rld_load": round(rld_load, 3),
    }
