"""Fitting the twin's models to what a serving app recorded: its engines' steps and its journeys.

Pure functions over samples (app/sim/calibrate.py measures them).

Steps of an idle engine run faster than the same steps while the app serves,
where the other engines, the conductor, the link emulators and the clients
share the host. `fit_to_app_steps` fits the model of the engine measured alone
to the steps timed inside the serving engines, per role. How much slower a step
runs depends on how many other engines of the host are busy meanwhile: each
step carries its start time, `busy_neighbors` counts the other engines in
flight over it, and the fit gives each role a slowdown with no busy neighbor
and one per busy neighbor (`FittedPerf.neighbor_slowdown`), which the twin
applies to its own busy replicas; one factor per role would carry the load of
the run it was measured at. The shape stays the one measured alone: served
traffic covers few batch shapes, too few to fit one.

The engines' queues and steps are not all of a request's time to its first
token: the conductor, Serve's routing, the token channel and each engine
replica's own input and output processing add to it, more under load.
`serving_overhead_ms` takes that share from a journey (its TTFT at the
conductor less the time vLLM's engine cores on the first token's way spent on
it). It grows with the requests in flight, whose tokens stream on the same
CPUs: `serving_overheads` pairs each request's with the others in flight when
it arrived, `fit_serving_overhead` fits a line to them (a median regression),
and `with_serving_overhead` puts it on the model of the role requests enter
by, which the twin adds to each.

Nor is a link's time all of a KV pull's: the connector's transport at both
ends takes its own. `kv_pulls` takes it from the journeys' pulls on links
inside a datacenter (each pull's time less its idle link's), `fit_kv_pulls`
fits a line over their size, and `with_kv_pull` puts it on the entry role's
model, from which the twin adds it to every pull. A decoder's replica
processes each request it gets after P's first token, as P's does the first:
`decoder_request_overheads` takes that time from the journeys, and
`with_decoder_overhead` puts its median on the entry role's model, by which
the twin delays each such request.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from app.config import Mode, PDDConfig, RoleName
from app.policy import Pipeline
from app.sim.cluster import entry_role
from app.sim.perf import FittedPerf, StepSample

#: Fewest timed steps a role's factor is taken from (`fit_to_app_steps`).
MIN_APP_STEPS = 20


def serving_overhead_ms(journey: Mapping) -> float | None:
    """Of a journey's TTFT at the conductor (GET /pdd/requests/{id}), the time
    outside the engines the first token waited for: P (or the one engine,
    colocated), and with P-D-naive and P-D-cross the decoder too, its KV pull included.

    Outside an engine is outside what the twin models of it, its queue and
    steps: the time in vLLM's engine core (`engine_core_ttft_ms`) where the
    journey has it for each of those engines, so the replica's own input and
    output processing counts as overhead; else the replicas' `engine_ttft_ms`.
    None for a journey without those figures (an error, a failover, an app too
    old to record them)."""
    ttft = journey.get("ttft_ms")
    if ttft is None or journey.get("error") or journey.get("failovers"):
        return None
    pipeline = journey.get("pipeline")
    if pipeline == Pipeline.colocated.value:
        engines = list(journey.get("engine_ttft_ms") or {})
        roles = engines if len(engines) == 1 else []
    elif pipeline in (Pipeline.p_d_naive.value, Pipeline.p_d_cross.value):
        roles = [RoleName.prefill.value, RoleName.main_decode.value]
    else:
        roles = [RoleName.prefill.value]
    for figures in ("engine_core_ttft_ms", "engine_ttft_ms"):
        engine = journey.get(figures) or {}
        if roles and all(role in engine for role in roles):
            return ttft - math.fsum(engine[role] for role in roles)
    return None


class OverheadSample(NamedTuple):
    """One request's serving overhead (`serving_overhead_ms`) and how many other
    requests the conductor had in flight when it arrived."""

    in_flight: int
    ms: float


def serving_overheads(journeys: Sequence[Mapping], mode: Mode | None = None) -> list[OverheadSample]:
    """The serving overhead of each of `journeys` (of `mode`, if given) that
    has one, with the other journeys in flight when it started (`started_at`):
    started before it and not finished by then, whatever their mode. A journey
    without `finished_at` is in flight to the end; failed ones count too, as
    they loaded the app all the same."""
    starts = sorted(t for j in journeys if (t := j.get("started_at")) is not None)
    ends = sorted(t for j in journeys if (t := j.get("finished_at")) is not None and j.get("started_at") is not None)
    samples = []
    for journey in journeys:
        at = journey.get("started_at")
        if at is not None and (mode is None or journey.get("mode") == mode.value) and (ms := serving_overhead_ms(journey)) is not None:
            samples.append(OverheadSample(max(0, bisect_left(starts, at) - bisect_right(ends, at)), ms))
    return samples


def fit_serving_overhead(samples: Sequence[OverheadSample]) -> tuple[float, float]:
    """(ms with no other request in flight, ms more per request in flight): the
    line with the least total absolute distance to the samples (`median_line`),
    so the few requests that waited far longer (a blocked event loop, a garbage
    collection, most often at the rare high counts in flight) do not pull it.
    Raises ValueError without samples."""
    if not samples:
        raise ValueError("no serving overhead samples")
    return median_line([float(s.in_flight) for s in samples], [s.ms for s in samples])


def median_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(base, slope) of the line with the least total absolute distance to the
    points (xs[i], ys[i]), a median regression; both kept >= 0. Points at one x
    only give their median and no slope."""

    def base(slope: float) -> float:
        return max(0.0, statistics.median([y - slope * x for x, y in zip(xs, ys)]))

    def distance(slope: float) -> float:
        b = base(slope)
        return math.fsum(abs(y - b - slope * x) for x, y in zip(xs, ys))

    if min(xs) == max(xs):
        return base(0.0), 0.0
    # the distance is convex in the slope (while the base stays above 0): a golden-section
    # search between no slope and the steepest any two points allow
    levels = sorted(set(xs))
    low, high = 0.0, (max(ys) - min(ys)) / min(upper - lower for lower, upper in zip(levels, levels[1:]))
    ratio = (math.sqrt(5) - 1) / 2
    while high - low > 1e-6 * (1 + high):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if distance(left) <= distance(right):
            high = right
        else:
            low = left
    slope = (low + high) / 2
    return base(slope), slope


CONTINUED = frozenset(p.value for p in (Pipeline.p_d, Pipeline.p_md, Pipeline.p_rld_md, Pipeline.p_p_md, Pipeline.p_rld))
"""Pipelines whose first token comes from P and whose decoders continue the stream."""


def decoder_request_overheads(journeys: Sequence[Mapping], mode: Mode | None = None) -> list[float]:
    """For each journey (of `mode`, if given) of a `CONTINUED` pipeline, each decoder replica's time on
    its request outside vLLM's engine core (`engine_ttft_ms` less
    `engine_core_ttft_ms`): its own input and output processing, which
    `serving_overhead_ms` counts only for the engines the first token waited for.
    Journeys with an error or a failover are left out."""
    samples = []
    for journey in journeys:
        if journey.get("error") or journey.get("failovers") or journey.get("pipeline") not in CONTINUED:
            continue
        if mode is not None and journey.get("mode") != mode.value:
            continue
        replica, core = journey.get("engine_ttft_ms") or {}, journey.get("engine_core_ttft_ms") or {}
        for role in (RoleName.relay_decode.value, RoleName.main_decode.value):
            if role in replica and role in core:
                samples.append(replica[role] - core[role])
    return samples


def with_decoder_overhead(models: Mapping[str, FittedPerf], mode: Mode, overheads: Sequence[float]) -> dict[str, FittedPerf]:
    """`models` with the median of `overheads` (`decoder_request_overheads`, kept >= 0)
    as the decoder request overhead on the model of the role `mode`'s requests enter
    by, from which the twin delays each request a decoder gets after P's first token.
    No overheads: `models` as they are."""
    if not overheads:
        return dict(models)
    return _on_entry_model(models, mode, decoder_request_overhead_ms=max(0.0, statistics.median(overheads)))


class PullSample(NamedTuple):
    """One KV pull over a link inside a datacenter: its size, and its time
    beyond what the link alone gives it."""

    mb: float
    ms: float


def kv_pulls(journeys: Sequence[Mapping], config: PDDConfig) -> list[PullSample]:
    """The pulls of `journeys` (their `transfers`) that ended well on links
    inside one datacenter, each less its link's time for it when idle (RTT and
    bandwidth: `LinkModel.transfer_seconds`). Pulls across datacenters are left
    out: they wait for each other on the WAN's shared bandwidth, which the twin
    models itself. Raises KeyError for a link the config does not have."""
    from app.engine.kv.link import LinkModel

    links: dict[str, LinkModel] = {}
    samples = []
    for journey in journeys:
        for pull in journey.get("transfers") or ():
            src, _, dst = str(pull.get("link", "")).partition("->")
            if src != dst or not pull.get("ok") or not pull.get("bytes"):
                continue
            link = links.get(src)
            if link is None:
                link = links[src] = LinkModel(config.link(src, dst))
            samples.append(PullSample(pull["bytes"] / 1e6, (pull["seconds"] - link.transfer_seconds(pull["bytes"])) * 1000))
    return samples


def fit_kv_pulls(samples: Sequence[PullSample]) -> tuple[float, float]:
    """(ms a pull, ms per MB) of the KV transport beyond the link: `median_line`
    over the pulls' sizes, so pulls that waited behind others on a busy CPU do
    not pull it. Raises ValueError without samples."""
    if not samples:
        raise ValueError("no KV pull samples")
    return median_line([s.mb for s in samples], [s.ms for s in samples])


def with_kv_pull(models: Mapping[str, FittedPerf], mode: Mode, pulls: Sequence[PullSample]) -> dict[str, FittedPerf]:
    """`models` with the KV transport's cost fitted to `pulls` (`fit_kv_pulls`)
    on the model of the role `mode`'s requests enter by, from which the twin
    adds it to every pull. No pulls: `models` as they are."""
    if not pulls:
        return dict(models)
    per_pull, per_mb = fit_kv_pulls(pulls)
    return _on_entry_model(models, mode, kv_pull_ms=per_pull, kv_pull_ms_per_mb=per_mb)


def with_serving_overhead(models: Mapping[str, FittedPerf], mode: Mode, overheads: Sequence[OverheadSample]) -> dict[str, FittedPerf]:
    """`models` (by role name) with the serving overhead fitted to `overheads`
    (`fit_serving_overhead`) on the model of the role `mode`'s requests enter
    by (`entry_role`), which the twin delays each request by. No overheads:
    `models` as they are."""
    if not overheads:
        return dict(models)
    base, per_in_flight = fit_serving_overhead(overheads)
    return _on_entry_model(models, mode, serving_overhead_ms=base, serving_overhead_ms_per_in_flight=per_in_flight)


def _on_entry_model(models: Mapping[str, FittedPerf], mode: Mode, **figures: float) -> dict[str, FittedPerf]:
    """`models` with `figures` set on the model of the role `mode`'s requests enter by, which carries the
    app's own costs; ValueError when that role has no model."""
    role = entry_role(mode).value
    if role not in models:
        raise ValueError(f"no step model for {role}, which {mode.value} requests enter by: it timed no step")
    return {**models, role: replace(models[role], **figures)}


class _Coverage:
    """The time one engine had a step in flight, from its steps' intervals."""

    def __init__(self, intervals: Sequence[tuple[float, float]]):
        merged: list[list[float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]
        self.before = [0.0]
        for a, b in merged:
            self.before.append(self.before[-1] + b - a)

    def _upto(self, t: float) -> float:
        i = bisect_right(self.starts, t) - 1
        return 0.0 if i < 0 else self.before[i] + min(t, self.ends[i]) - self.starts[i]

    def within(self, a: float, b: float) -> float:
        return self._upto(b) - self._upto(a)


def busy_neighbors(steps: Mapping[RoleName, Sequence[StepSample]]) -> dict[RoleName, list[float]]:
    """For each timed step, how many other engines of the app had a step in
    flight while it ran (averaged over its duration). Engines are told apart by
    role and `StepSample.engine`. Raises ValueError when a step has no start time."""
    intervals: dict[tuple[RoleName, str], list[tuple[float, float]]] = {}
    for role, samples in steps.items():
        for s in samples:
            if s.start_s is None:
                raise ValueError(f"a {role.value} step has no start time (start_s): time the steps with this version of the app")
            intervals.setdefault((role, s.engine), []).append((s.start_s, s.start_s + s.step_ms / 1000))
    cover = {engine: _Coverage(spans) for engine, spans in intervals.items()}
    out: dict[RoleName, list[float]] = {}
    for role, samples in steps.items():
        out[role] = []
        for s in samples:
            assert s.start_s is not None  # every step's was checked above
            a, b = s.start_s, s.start_s + s.step_ms / 1000
            others = math.fsum(c.within(a, b) for engine, c in cover.items() if engine != (role, s.engine))
            out[role].append(others / (b - a) if b > a else 0.0)
    return out


class RoleFit(NamedTuple):
    """A role's step model fitted to the steps its engines timed in the serving app."""

    model: FittedPerf
    factor: float | None
    """The role's steps over the time the base model gives them; with host
    sharing, that ratio with no busy neighbor engine. None: too few steps, and
    `model` is the base."""
    neighbor_slowdown: float = 0.0
    """Each busy neighbor engine's share of slowdown (`FittedPerf.neighbor_slowdown`)."""
    neighbors: float | None = None
    """Busy neighbor engines while the role's steps ran, weighted by their time; None without host sharing."""

    def describe(self) -> str:
        if self.factor is None:
            return "too few timed steps: kept at the engine alone's model"
        if self.neighbors is None:
            return f"{self.factor:.2f}x the engine alone"
        return (
            f"{self.factor:.2f}x the engine alone with no busy neighbor engine, +{self.neighbor_slowdown:.0%} per busy "
            f"neighbor ({self.neighbors:.2f} busy on average)"
        )


def fit_to_app_steps(
    base: FittedPerf, steps: Mapping[RoleName, Sequence[StepSample]], min_steps: int = MIN_APP_STEPS, host_sharing: bool = True
) -> dict[str, RoleFit]:
    """`base` fitted per role to the steps that role's engines took (keyed by
    role name, as the twin's `perf` takes the models).

    With `host_sharing` and steps that carry their start times, a step of alone
    time t that ran while k other engines were busy (`busy_neighbors`) is fitted
    as t x (s0 + s1 k), least squares on the step times, s0 > 0 and s1 >= 0:
    the model is `base` x s0 with `neighbor_slowdown` s1 / s0, and the twin
    applies the same rule to its own busy engines. Otherwise one factor: the
    steps' measured time over the time `base` gives them.

    A role with fewer than `min_steps` steps keeps `base` (factor None); one
    with none is left out (it did not serve)."""
    timed = host_sharing and all(s.start_s is not None for samples in steps.values() for s in samples)
    neighbors = busy_neighbors(steps) if timed else {}
    fits: dict[str, RoleFit] = {}
    for role, samples in steps.items():
        if not samples:
            continue
        if len(samples) < min_steps:
            fits[role.value] = RoleFit(base, None)
            continue
        measured = [s.step_ms for s in samples]
        alone = [base.step_s(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read, s.attention_pairs, s.prefix_chunks) * 1000 for s in samples]
        if math.fsum(alone) <= 0:
            raise ValueError("the base model gives these steps no time: calibrate it on a real engine first")
        factor = math.fsum(measured) / math.fsum(alone)
        if not timed:
            fits[role.value] = RoleFit(base.scaled(factor), factor)
            continue
        k = neighbors[role]
        s0, s1 = _fit_slowdown(measured, alone, k) or (factor, 0.0)
        mean_k = math.fsum(m * x for m, x in zip(measured, k)) / math.fsum(measured)
        fits[role.value] = RoleFit(replace(base.scaled(s0), neighbor_slowdown=s1 / s0), s0, s1 / s0, mean_k)
    if not fits:
        raise ValueError("no engine timed a step: set roles.ROLE.engine.record_steps and send traffic first")
    return fits


def _fit_slowdown(measured: Sequence[float], alone: Sequence[float], neighbors: Sequence[float]) -> tuple[float, float] | None:
    """(s0, s1) of measured ~ alone x (s0 + s1 x neighbors), least squares; None when the neighbors
    have no measurable effect (none was ever busy, s1 < 0, or a degenerate spread gives s0 <= 0)."""
    import numpy as np

    if not any(neighbors):
        return None
    x = np.stack([np.asarray(alone), np.asarray(alone) * np.asarray(neighbors)], axis=1)
    (s0, s1), *_ = np.linalg.lstsq(x, np.asarray(measured), rcond=None)
    return (float(s0), float(s1)) if s1 >= 0 and s0 > 0 else None
