"""Figures derived from a Snapshot and the config: SLO score, loads, WAN slowdown, valley share.

Pure functions; diagnose, the specialists and verify all read the cluster
through these, so they agree on what "RLD load" or "WAN slowdown" means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.config import HandoffConfig, LinkConfig, PDDConfig, RoleName, SLOConfig
from app.engine.deployments import DEPLOYMENT_NAMES
from app.policy import Pipeline, relay_cap
from app.telemetry.snapshot import Snapshot

#: The middle of the hit-rate range where PDD's benefit dips (the bathtub's
#: valley, PDD.md mechanism 6): neither end's advantage applies there.
VALLEY = (0.2, 0.8)


def slo_figures(snap: Snapshot, slo: SLOConfig) -> dict[str, float]:
    """Each objective's figure at the SLO percentile divided by its target (1.0 = at target)."""
    out = {}
    if snap.ttft_p is not None:
        out["ttft"] = snap.ttft_p * 1000 / slo.ttft_ms
    if snap.tpot_p is not None:
        out["tpot"] = snap.tpot_p * 1000 / slo.tpot_ms
    if snap.gap_p is not None:
        out["gap"] = snap.gap_p * 1000 / slo.max_gap_ms
    return out


def slo_score(figures: dict[str, float]) -> float | None:
    """The worst objective (None without traffic)."""
    return max(figures.values()) if figures else None


def deployment(role: RoleName) -> str:
    return DEPLOYMENT_NAMES[role]


def healthy_replicas(snap: Snapshot, dep: str) -> float | None:
    """Healthy replicas of Serve deployment `dep`; None when Serve reports nothing of it.

    Serve exports one healthy series per live replica, so a deployment that has a
    target but no series has no replica alive (its only one died, the next is not up)."""
    healthy = snap.replicas_healthy_by_deployment.get(dep)
    if healthy is None and snap.replicas_target_by_deployment.get(dep):
        return 0.0
    return healthy


def role_load(snap: Snapshot, config: PDDConfig, role: RoleName) -> float | None:
    """Requests in progress per batch slot across a role's healthy replicas (0..1+)."""
    rc = config.roles.get(role)
    name = deployment(role)
    healthy = snap.replicas_healthy_by_deployment.get(name)
    ongoing = snap.ongoing_by_deployment.get(name)
    if rc is None or not healthy or ongoing is None:
        return None
    return ongoing / (healthy * rc.engine.max_num_seqs)


def gap_ratio(snap: Snapshot, slo: SLOConfig, pipeline: str) -> float | None:
    """A pipeline's worst-gap p99 / the gap target (None without its requests in the window)."""
    gap = snap.gap_p99_by_pipeline.get(pipeline)
    return gap * 1000 / slo.max_gap_ms if gap is not None else None


def gap_error_s(snap: Snapshot) -> float | None:
    """The largest mean gap prediction error over the links (seconds; above 0 routing under-predicts)."""
    return max(snap.gap_error_mean_by_link.values()) if snap.gap_error_mean_by_link else None


def relay_cap_now(snap: Snapshot, config: PDDConfig, handoff: HandoffConfig) -> int:
    """The most tokens a relay may produce at RLD's load now (app/policy.py `relay_cap`)."""
    return relay_cap(handoff, role_load(snap, config, RoleName.relay_decode) or 0.0)


def relay_cap_use(snap: Snapshot, config: PDDConfig, handoff: HandoffConfig) -> float | None:
    """Relay tokens p90 / the relay cap at RLD's load now: near 1, relays run to their cap."""
    if snap.relay_tokens_p90 is None:
        return None
    return snap.relay_tokens_p90 / relay_cap_now(snap, config, handoff)


def hit_cdf(buckets: dict[str, float], x: float) -> float | None:
    """Share of observations at or below `x`, interpolated inside a bucket."""
    points = sorted((float(le), v) for le, v in buckets.items())
    if not points or points[-1][1] <= 0:
        return None
    total = points[-1][1]
    prev_le, prev_v = 0.0, 0.0
    for le, v in points:
        if x <= le:
            if math.isinf(le) or le == prev_le:
                return v / total
            return (prev_v + (v - prev_v) * (x - prev_le) / (le - prev_le)) / total
        prev_le, prev_v = le, v
    return 1.0


def valley_share(snap: Snapshot) -> float | None:
    """Share of MD requests whose prefix hit sits in the valley band."""
    lo = hit_cdf(snap.md_hit_buckets, VALLEY[0])
    hi = hit_cdf(snap.md_hit_buckets, VALLEY[1])
    if lo is None or hi is None:
        return None
    return max(0.0, hi - lo)


def singular_share(snap: Snapshot) -> float | None:
    total = snap.request_rate
    if snap.singular_rate is None or total <= 0:
        return None
    return snap.singular_rate / total


def hit_gap(snap: Snapshot) -> float | None:
    """How far MD's prefix hit trails P's (cached/prompt tokens)."""
    p = snap.prefix_hit_by_role.get(RoleName.prefill.value)
    md = snap.prefix_hit_by_role.get(RoleName.main_decode.value)
    if p is None or md is None:
        return None
    return p - md


@dataclass(frozen=True)
class LinkHealth:
    link: str
    """The link label as exported (e.g. `dc-a->dc-b`)."""
    observed_s: float
    """Mean seconds per pull over the window."""
    expected_s: float
    """What the configured link needs for these pulls, each beside the pulls that shared it."""
    p90_s: float | None
    failure_ratio: float
    """Pulls the link broke (cut, reset, timed out) / pulls; leases gone before their pull are not counted."""
    slowdown: float
    """Observed / expected: 1 on a link as configured, however busy."""
    shared: bool = True
    """Whether `expected_s` counts the pulls sharing the link (the conductor's model of each
    pull); without it (no pull routing sized: pd_cross_dc_naive), an idle link's time for the
    mean pull, which a busy link exceeds."""
    bandwidth_mbps: float = 0.0
    """The configured bandwidth."""
    utilisation: float = 0.0
    """Bytes pulled per second / the configured bandwidth."""
    lease_gone_ratio: float = 0.0
    """Pulls that found their lease gone (expired while they waited) / pulls."""


def expected_pull_s(link: LinkConfig, nbytes: float) -> float:
    """Mean seconds of one pull of `nbytes` on the link as configured, when it carries nothing else."""
    return link.mean_latency_s + nbytes / link.bytes_per_s


def _datacenters_in(label: str, config: PDDConfig) -> list[str]:
    names = {g.datacenter for g in config.node_groups.values()}
    # longest first, so `dc-a` inside `dc-ab` is not mistaken for it
    found: list[str] = []
    rest = label
    for name in sorted(names, key=len, reverse=True):
        if name in rest:
            found.append(name)
            rest = rest.replace(name, "\0")
    return found


def wan_links(snap: Snapshot, config: PDDConfig) -> list[LinkHealth]:
    """Health of every cross-datacenter link that carried KV pulls in the window."""
    out = []
    for label, mean_s in sorted(snap.kv_seconds_mean_by_link.items()):
        dcs = _datacenters_in(label, config)
        if len(dcs) != 2:
            continue
        try:
            link = config.link(*dcs)
        except KeyError:
            continue
        slowdown = snap.kv_slowdown_mean_by_link.get(label)
        if slowdown is not None and slowdown > 0:
            shared = True
            expected = mean_s / slowdown
        else:
            shared = False
            expected = expected_pull_s(link, snap.kv_bytes_per_transfer_by_link.get(label, 0.0))
            slowdown = mean_s / expected if expected > 0 else 1.0
        pulls = snap.kv_transfer_rate_by_link.get(label, 0.0)
        gone = snap.kv_lease_gone_rate_by_link.get(label, 0.0)
        fails = max(0.0, snap.kv_failure_rate_by_link.get(label, 0.0) - gone)
        out.append(
            LinkHealth(
                link=label,
                observed_s=mean_s,
                expected_s=expected,
                p90_s=snap.kv_seconds_p90_by_link.get(label),
                failure_ratio=fails / pulls if pulls > 0 else (1.0 if fails > 0 else 0.0),
                slowdown=slowdown,
                shared=shared,
                bandwidth_mbps=link.bandwidth_mbps,
                utilisation=pulls * snap.kv_bytes_per_transfer_by_link.get(label, 0.0) / link.bytes_per_s,
                lease_gone_ratio=gone / pulls if pulls > 0 else 0.0,
            )
        )
    return out


def worst_tpot_pipeline(snap: Snapshot) -> str | None:
    if not snap.tpot_p_by_pipeline:
        return None
    return max(snap.tpot_p_by_pipeline, key=lambda p: snap.tpot_p_by_pipeline[p])


P_MD = Pipeline.p_md.value
P_RLD_MD = Pipeline.p_rld_md.value
P_P_MD = Pipeline.p_p_md.value
#: Pipelines whose tokens after the first come from a relay (RLD, or P while no RLD is alive).
RELAYED = (P_RLD_MD, Pipeline.p_rld.value, P_P_MD)
