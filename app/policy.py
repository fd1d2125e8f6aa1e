"""Pure decisions: which pipeline a request takes, and how RLD hands it to MD.

No I/O and no clocks: the conductor (real requests) and the digital twin
(app/sim) call exactly these functions with the facts they have, so what the
twin predicts is what the cluster does.

Rules (docs/design.md):
- P-MD when the gap it causes is short enough: MD's pull of what it lacks,
  behind the WAN's backlog, then MD's wait for a step and its extend step, and
  its first token's way back, as finished journeys correct that prediction
  (`GapCorrection`); P-RLD-MD
  otherwise, so a relay decoder in A masks the gap.
- P-RLD (ending at RLD) is never chosen, except by the singular-traffic filter
  (ultra-long, low-hit input with a tiny output) and while the WAN is down,
  because requests ending at RLD leave MD's cache behind P's and overload RLD.
- While no RLD is alive, the prefill replica relays instead (P-P-MD), unless
  `routing.prefill_relays` is off.
- A saturated RLD is not given more relays: the request goes P-MD and pays the
  transfer rather than queueing behind other relays.
- A conversation stays on the replicas holding its context until their batch is
  full (`affinity_room`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from app.config import EngineConfig, HandoffConfig, HandoffMode, RoutingConfig


class Pipeline(str, Enum):
    colocated = "colocated"
    p_d = "P-D"
    """Classic PD within one datacenter (pd_intra_dc)."""
    p_d_naive = "P-D-naive"
    """Classic PD across the WAN, full KV, first token from the decoder (pd_cross_dc_naive)."""
    p_d_cross = "P-D-cross"
    """PD across the WAN, only the blocks the decoder lacks, first token from the decoder (pd_cross_dc)."""
    p_md = "P-MD"
    p_rld_md = "P-RLD-MD"
    p_p_md = "P-P-MD"
    """P-RLD-MD with the prefill replica as the relay, while no relay decoder is alive."""
    p_rld = "P-RLD"
    """Singular filter only."""


@dataclass(frozen=True)
class RequestFacts:
    prompt_tokens: int
    max_tokens: int
    md_cached_tokens: int
    """Prompt tokens the chosen MD replica is expected to hold already."""


@dataclass(frozen=True)
class LinkFacts:
    bandwidth_bytes_per_s: float
    rtt_s: float


@dataclass(frozen=True)
class ClusterFacts:
    kv_bytes_per_block: int
    block_size: int
    wan: LinkFacts
    rld_load: float
    """Occupancy of the least loaded RLD replica: active relays / its batch limit."""
    rld_available: bool = True
    wan_up: bool = True
    """False while the WAN between P and MD is cut: requests then finish in A."""
    md_available: bool = True
    """False when no main decoder is alive (its datacenter is down)."""
    wan_backlog_bytes: int = 0
    """KV bytes already queued on the WAN by requests in flight: a new pull waits behind them."""
    md_wait_ms: float = 0.0
    """MD's side of the gap once its pull is done (`decoder_wait_ms`)."""
    gap_correction_ms: float = 0.0
    """What finished P-MD journeys say the prediction misses on this link and MD (`GapCorrection`)."""


@dataclass(frozen=True)
class RouteDecision:
    pipeline: Pipeline
    blocks_to_send: int
    expected_wan_ms: float
    md_hit_rate: float
    reason: str
    predicted_gap_ms: float = 0.0
    """The gap P-MD would cause, whichever pipeline was chosen (`uncorrected_gap_ms` and the
    correction; never negative)."""
    uncorrected_gap_ms: float = 0.0
    """The pull, MD's wait and its first token's way back over the WAN: what a turn's gap corrects."""


@dataclass
class LinkBacklog:
    """KV bytes routed onto a link that the link, as configured, has not moved yet.

    Pulls join the queue when they start and drain at the configured bandwidth
    (a fluid FIFO). Routing estimates every transfer from the configured link
    model, so its queue drains by the same model: a pull is gone when the
    configured link would have moved it, however late its decoder reports. A
    link slower than configured shows up in the agents' figures instead, and
    they retune the threshold.

    What a pull did not move leaves the queue when its decoder says so (`settle`):
    routing's estimate counts the blocks its prefix index believes the decoder
    lacks, and a decoder whose cache held more, or whose pull failed, moves less.
    Left queued, those bytes would push later requests onto the relay for nothing.
    """

    bytes_per_s: float
    _routed: float = 0.0
    """Bytes ever routed onto the link: a pull's place in the queue is its last byte's."""
    _gone: float = 0.0
    """Bytes ever moved by the model, or settled as never crossing."""
    _at: float = 0.0

    def queued(self, now: float) -> int:
        """Bytes still queued at `now` (seconds, any monotonic clock)."""
        left = self._routed - self._gone
        if left:
            self._gone += min(left, (now - self._at) * self.bytes_per_s)
        self._at = now
        return round(self._routed - self._gone)

    def add(self, nbytes: int, now: float) -> float:
        """Queue a pull of `nbytes`; its place, for `settle`."""
        self.queued(now)
        self._routed += nbytes
        return self._routed

    def settle(self, place: float, nbytes: int, moved: int, now: float) -> None:
        """The pull queued at `place` with `nbytes` moved `moved`: the rest never crosses.
        Only what the model has not moved of it yet leaves the queue."""
        self.queued(now)
        unmoved = min(float(nbytes), place - self._gone)
        if unmoved > 0 and moved < nbytes:
            self._gone += min(unmoved, nbytes - moved)


def affinity_room(engine: EngineConfig) -> int:
    """Requests a replica runs before routing moves its conversations to a less busy one
    (`PrefixIndex.choose`'s `room`): its batch, full.

    A move costs the conversation's whole cached context: pulled again by a decoder (over the
    WAN for a main decoder), computed again by a replica that prefills. For an agentic turn that
    is tens of thousands of tokens against a few hundred new ones, far more than waiting behind a
    few requests. Giving conversations up at `imbalance_limit` requests above the idlest turned a
    cold start into a lasting overload in the twin: the moved turns missed their caches, queues
    grew, more turns moved (intra-DC PD at paper_table's scale and 100.6 RPS stayed overloaded
    for 18 minutes, 3 with this room)."""
    return engine.max_num_seqs


def blocks_missing(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """Blocks of the prompt's KV the decoder lacks (a partial last block counts)."""
    cached_blocks = min(cached_tokens, prompt_tokens) // block_size
    return max(0, math.ceil(prompt_tokens / block_size) - cached_blocks)


def expected_transfer_ms(blocks: int, bytes_per_block: int, link: LinkFacts, backlog_bytes: int = 0) -> float:
    """One pull: a round trip, then its bytes at the link's bandwidth behind those already queued."""
    if blocks <= 0:
        return 0.0
    return (link.rtt_s + (backlog_bytes + blocks * bytes_per_block) / link.bandwidth_bytes_per_s) * 1000


def decoder_wait_ms(step_ms: float, running: int, batch_limit: int) -> float:
    """MD's wait once its pull is done: the step it is in, then the extend step that computes the
    first token's KV and samples the next. A request beyond the batch also waits for a slot,
    counted as one step per request ahead; what that misses, the correction learns."""
    ahead = max(0, running + 1 - batch_limit)
    return step_ms * (2 + ahead)


#: `GapCorrection` defaults: each journey moves the correction a quarter of the way to its error,
#: an idle correction halves every two minutes, and it never exceeds two seconds either way.
GAP_CORRECTION_GAIN = 0.25
GAP_CORRECTION_HALF_LIFE_S = 120.0
GAP_CORRECTION_MAX_MS = 2000.0
#: Keys (link and MD replica) kept: replicas come and go, the oldest entries leave first.
GAP_CORRECTION_KEYS = 256


class GapCorrection:
    """What the gap prediction misses, per link and MD replica, learned from finished P-MD turns.

    The prediction (pull + `decoder_wait_ms`) leaves out what neither model sees: MD's steps
    slowed by other requests' warm-ups, a pull's own set-up, a token channel's hops. Each turn's
    error (its gap as seen, less the uncorrected prediction) moves the correction `gain` of the
    way; the correction is bounded (one slow turn cannot stop P-MD for long) and decays between
    observations, so an error that stopped happening is forgotten even if no turn goes P-MD to
    say so (a large correction sends every turn to the relay, which observes nothing)."""

    def __init__(
        self,
        gain: float = GAP_CORRECTION_GAIN,
        half_life_s: float = GAP_CORRECTION_HALF_LIFE_S,
        max_ms: float = GAP_CORRECTION_MAX_MS,
        max_keys: int = GAP_CORRECTION_KEYS,
    ):
        self.gain, self.half_life_s, self.max_ms, self.max_keys = gain, half_life_s, max_ms, max_keys
        self._values: dict[str, tuple[float, float]] = {}
        """key -> (correction ms, when it was last set), oldest first."""

    def value(self, key: str, now: float) -> float:
        """The correction for `key` at `now` (seconds, any monotonic clock): 0 for an unknown key."""
        if key not in self._values:
            return 0.0
        correction, at = self._values[key]
        return correction * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def observe(self, key: str, uncorrected_ms: float, actual_ms: float, now: float) -> float:
        """A finished turn's gap, against its prediction without correction; the new correction."""
        correction = self.value(key, now)
        correction += self.gain * (actual_ms - uncorrected_ms - correction)
        correction = min(self.max_ms, max(-self.max_ms, correction))
        self._values.pop(key, None)
        self._values[key] = (correction, now)
        while len(self._values) > self.max_keys:
            del self._values[next(iter(self._values))]
        return correction


def is_singular(req: RequestFacts, hit_rate: float, routing: RoutingConfig) -> bool:
    s = routing.singular
    return s.enabled and req.prompt_tokens >= s.min_prompt_tokens and hit_rate <= s.max_hit_rate and req.max_tokens <= s.max_output_tokens


def choose_pipeline(req: RequestFacts, cluster: ClusterFacts, routing: RoutingConfig) -> RouteDecision:
    blocks = blocks_missing(req.prompt_tokens, req.md_cached_tokens, cluster.block_size)
    wan_ms = expected_transfer_ms(blocks, cluster.kv_bytes_per_block, cluster.wan, cluster.wan_backlog_bytes)
    uncorrected = wan_ms + cluster.md_wait_ms + cluster.wan.rtt_s * 500  # MD's first token crosses back: half a round trip
    gap_ms = max(0.0, uncorrected + cluster.gap_correction_ms)
    hit = min(req.md_cached_tokens, req.prompt_tokens) / req.prompt_tokens if req.prompt_tokens else 1.0

    def decide(pipeline: Pipeline, reason: str) -> RouteDecision:
        return RouteDecision(pipeline, blocks, wan_ms, hit, reason, gap_ms, uncorrected)

    if not (cluster.wan_up and cluster.md_available) and cluster.rld_available:
        why = "WAN down" if not cluster.wan_up else "no main decoder alive"
        return decide(Pipeline.p_rld, f"{why}: the relay finishes the request in datacenter A")
    cheap = gap_ms <= routing.max_wan_transfer_ms
    hit_ok = routing.min_hit_rate is None or hit >= routing.min_hit_rate
    gap = f"predicted gap {gap_ms:.0f} ms (WAN transfer {wan_ms:.0f} ms)"
    if cheap and hit_ok:
        return decide(Pipeline.p_md, f"{gap} within {routing.max_wan_transfer_ms:.0f} ms")
    if not cluster.rld_available:
        if routing.prefill_relays and cluster.md_available:
            return decide(Pipeline.p_p_md, "no relay decoder alive: prefill relays while MD pulls")
        return decide(Pipeline.p_md, "no relay decoder available")
    if is_singular(req, hit, routing):
        return decide(Pipeline.p_rld, f"singular: {req.prompt_tokens}-token prompt, hit {hit:.0%}, {req.max_tokens} output tokens")
    if cluster.rld_load >= routing.max_relay_load:
        return decide(Pipeline.p_md, f"relay saturated ({cluster.rld_load:.0%} >= {routing.max_relay_load:.0%})")
    why = f"{gap} over {routing.max_wan_transfer_ms:.0f} ms" if not cheap else f"MD hit {hit:.0%} below {routing.min_hit_rate:.0%}"
    return decide(Pipeline.p_rld_md, why)


class HandoffStep(str, Enum):
    catch_up = "catch_up"
    """Warm MD with the eager tokens so far; RLD keeps decoding."""
    final = "final"
    """Hand everything over: RLD stops, MD continues the stream."""


#: Catch-up rounds per request before the final step (each round shrinks what is left).
MAX_CATCH_UP_ROUNDS = 3
#: RLD occupancy above which auto mode prefers one-shot (frees the relay soonest).
AUTO_ONE_SHOT_LOAD = 0.5


def resolve_handoff_mode(handoff: HandoffConfig, rld_load: float) -> HandoffMode:
    """auto -> catch_up while RLD has headroom (smaller MD steps), one_shot under pressure."""
    if handoff.mode is not HandoffMode.auto:
        return handoff.mode
    return HandoffMode.one_shot if rld_load >= AUTO_ONE_SHOT_LOAD else HandoffMode.catch_up


def next_handoff_step(pending_tokens: int, rounds_done: int, mode: HandoffMode, handoff: HandoffConfig) -> HandoffStep:
    """What to do with `pending_tokens` eager tokens MD has not yet computed."""
    if mode is HandoffMode.catch_up and pending_tokens > handoff.catch_up_threshold_tokens and rounds_done < MAX_CATCH_UP_ROUNDS:
        return HandoffStep.catch_up
    return HandoffStep.final


def relay_cap(handoff: HandoffConfig, rld_load: float) -> int:
    """Most tokens RLD may produce for one request; shrinks as RLD fills up."""
    scaled = handoff.relay_cap_tokens * max(0.0, 1.0 - rld_load)
    return max(handoff.min_relay_cap_tokens, int(scaled))


class RelayPhase(str, Enum):
    relaying = "relaying"
    """RLD's tokens go to the client while MD warms up or catches up."""
    waiting = "waiting"
    """RLD stopped (its cap, or it failed): the client waits for MD's step, the final one."""
    handed_over = "handed_over"
    """MD continues the stream."""
    relay_finished = "relay_finished"
    """RLD ended the request before any handoff."""


@dataclass
class RelayMachine:
    """One P-RLD-MD request from P's first token on, as the conductor (app/conductor/relay.py)
    and the twin (app/sim/pdd.py) both run it. Counts are of eager tokens: those after P's
    first token that the client got from the relay."""

    cap: int
    mode: HandoffMode
    handoff: HandoffConfig
    phase: RelayPhase = RelayPhase.relaying
    relayed: int = 0
    """Eager tokens the client has."""
    sent: int = 0
    """Of those, the ones MD's steps computed or are computing."""
    rounds: int = 0
    """Catch-up rounds so far."""

    @classmethod
    def start(cls, handoff: HandoffConfig, rld_load: float) -> RelayMachine:
        return cls(relay_cap(handoff, rld_load), resolve_handoff_mode(handoff, rld_load), handoff)

    def take(self, offered: int, last: bool) -> int:
        """RLD produced `offered` more tokens (`last`: its final ones). How many the client
        takes: none past the cap; reaching the cap stops the relay."""
        n = max(0, min(offered, self.cap - self.relayed))
        self.relayed += n
        if last and n == offered:
            self.phase = RelayPhase.relay_finished
        elif self.relayed >= self.cap:
            self.phase = RelayPhase.waiting
        return n

    def relay_stopped(self) -> None:
        """RLD's stream ended without finishing the request (it failed, with no replacement)."""
        if self.phase is RelayPhase.relaying:
            self.phase = RelayPhase.waiting

    def md_failed(self, max_tokens: int) -> None:
        """MD cannot take over: a relay still going finishes the request, uncapped; one that
        stopped leaves the final step to another decoder."""
        if self.phase is RelayPhase.relaying:
            self.cap = max_tokens
        elif self.phase is RelayPhase.waiting:
            self.phase = RelayPhase.handed_over

    def md_step_done(self) -> HandoffStep:
        """MD finished a step (its warm-up or a catch-up round): another round over the tokens
        relayed since, or the final step (RLD stops, MD continues the stream)."""
        if self.phase is RelayPhase.relaying:
            if next_handoff_step(self.relayed - self.sent, self.rounds, self.mode, self.handoff) is HandoffStep.catch_up:
                self.rounds += 1
                self.sent = self.relayed
                return HandoffStep.catch_up
        self.phase = RelayPhase.handed_over
        return HandoffStep.final
