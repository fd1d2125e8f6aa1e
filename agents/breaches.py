"""SLO breaches: every objective in `slo` (TTFT, TPOT, worst gap) is a situation of its own once
its figure at the SLO percentile is over the target, with at least MIN_BREACH_REQUESTS requests
over it in the window.

TTFT and TPOT name the objective; capacity judges which role would ease it. A worst-gap breach
names the pipeline whose gap p99 is over the target (its subject) and the cause:
- P-MD: `routing.max_wan_transfer_ms` bounds the gap a P-MD turn is predicted to cause (MD's pull
  of the blocks it lacks behind the link's backlog, its wait for a step, the extend step, corrected
  online). P-MD gaps over the target on a link that is not degraded: the threshold is too high for
  the gap; a positive gap prediction error says the prediction misses part of the stall. Routing
  lowers the threshold.
- P-RLD-MD: the stream stalls at the handoff: relays that run to their cap stop before MD holds the
  KV (the cap is too small), or a one-shot handoff waits while MD recomputes every relayed token.
  Handoff's knobs.
- another pipeline (P-P-MD while no relay decoder is alive, P-RLD): a notice for a person.

Where another situation already explains a pipeline's long gaps, the breach is not named for that
pipeline: that situation's remedy is the specific one, and both acting on the same evidence would
move the same knobs twice (one unit after the other: agents/guard.py), overshooting.
- P-MD: wan_degradation (a slow or failing link: the threshold goes to intent / slowdown, which a
  gap breach would lower again), wan_saturated (a full link: relaying more pulls the same bytes; a
  person decides), bathtub_valley (valley requests take the relay by the hit threshold instead).
- P-RLD-MD: wan_degradation (the relay cap rises to cover the slow pull), rld_overload and
  relay_saturated (relays are cut short by RLD's load: their own remedies come first).
So agents/diagnose.py runs these checks after the WAN, valley and RLD ones.
"""

from __future__ import annotations

from collections.abc import Callable

from agents import figures as f
from agents.controllers import gap_threshold_ceiling
from agents.judge import Judge
from agents.knobs import get_knob
from agents.situations import (
    BATHTUB_VALLEY,
    GAP_BREACH,
    MIN_BREACH_REQUESTS,
    RELAY_AT_CAP,
    RELAY_SATURATED,
    RLD_OVERLOAD,
    SLO_RATIO,
    TPOT_BREACH,
    TTFT_BREACH,
    WAN_DEGRADATION,
    WAN_SATURATED,
    Evidence,
)
from app.config import HandoffMode, RoleName

THRESHOLD = "routing.max_wan_transfer_ms"

Cause = tuple[str, list[Evidence]]


def objectives(d: Judge) -> None:
    _ttft_tpot(d)
    _gap(d)


def _over(d: Judge, slo: str) -> float:
    """Requests over the objective's target in the window."""
    return d.snap.slo_violation_rate_by_slo.get(slo, 0.0) * d.snap.window_s


def _over_evidence(d: Judge, over: float) -> Evidence:
    return Evidence(
        query=f"{d.q('slo_violation_rate_by_slo')} x {d.snap.window_s:g} s",
        value=over,
        threshold=MIN_BREACH_REQUESTS,
        note="requests over the target in the window",
    )


def _ttft_tpot(d: Judge) -> None:
    slo = d.config.slo
    for name, value, target, label in (
        (TTFT_BREACH, d.snap.ttft_p, slo.ttft_ms, "ttft_p"),
        (TPOT_BREACH, d.snap.tpot_p, slo.tpot_ms, "tpot_p"),
    ):
        ratio = value * 1000 / target if value is not None else None
        over = _over(d, label[:4])
        if value is not None and d.past(name, ratio, SLO_RATIO) and over >= MIN_BREACH_REQUESTS - 1e-9:
            by = label.replace("_p", "_p_by_pipeline")
            per = getattr(d.snap, by)
            d.add(
                name,
                f"{label[:4].upper()} p{slo.percentile:g} {value * 1000:.0f} ms over the {target:.0f} ms target",
                [
                    Evidence(query=d.q(label), value=value, threshold=target / 1000, note="seconds"),
                    *(Evidence(query=d.q(by), value=v, note=p) for p, v in sorted(per.items())),
                    _over_evidence(d, over),
                ],
                severity=2,
                figure=ratio,
            )


def _gap(d: Judge) -> None:
    slo = d.config.slo
    value = d.snap.gap_p
    ratio = value * 1000 / slo.max_gap_ms if value is not None else None
    over = _over(d, "gap")
    on = any(key.partition(":")[0] == GAP_BREACH for key in d.memory.streaks)
    if value is None or ratio is None or ratio < SLO_RATIO[1 if on else 0] or over < MIN_BREACH_REQUESTS - 1e-9:
        return
    head = f"worst gap p{slo.percentile:g} {value * 1000:.0f} ms over the {slo.max_gap_ms:.0f} ms target"
    base = [Evidence(query=d.q("gap_p"), value=value, threshold=slo.max_gap_ms / 1000, note="seconds"), _over_evidence(d, over)]
    per = {p: r for p in d.snap.gap_p99_by_pipeline if (r := f.gap_ratio(d.snap, slo, p)) is not None}
    breaching = [p for p in per if d.past(f"{GAP_BREACH}:{p}", per[p], SLO_RATIO)] or ([max(per, key=per.__getitem__)] if per else [])
    if not breaching:
        d.add(GAP_BREACH, f"{head}; no pipeline's gaps in the window say which", base, severity=2, figure=ratio)
        return
    for pipeline in sorted(breaching, key=lambda p: -per[p]):
        cause = CAUSES.get(pipeline, _other)(d)
        if cause is None:
            continue
        why, evidence = cause
        gap = d.snap.gap_p99_by_pipeline[pipeline]
        d.add(
            GAP_BREACH,
            f"{head}; {pipeline} worst-gap p99 {gap * 1000:.0f} ms: {why}",
            [
                *base,
                Evidence(query=d.q("gap_p99_by_pipeline"), value=gap, threshold=slo.max_gap_ms / 1000, note=f"{pipeline} worst-gap p99 seconds"),
                *evidence,
            ],
            subject=pipeline,
            severity=2,
            figure=per[pipeline],
        )


def _p_md(d: Judge) -> Cause | None:
    if d.active(WAN_DEGRADATION, WAN_SATURATED, BATHTUB_VALLEY):
        return None
    threshold = get_knob(d.knobs, THRESHOLD)
    err = f.gap_error_s(d.snap)
    worst = d.worst_link()
    link = f"on a link {worst.slowdown:.1f}x its model, " if worst is not None else ""
    miss = f"; the gap prediction misses {err * 1000:.0f} ms a turn on average" if err is not None and err > 0 else ""
    ceiling = gap_threshold_ceiling(d.config.slo.max_gap_ms, err)
    return (
        f"{link}routing.max_wan_transfer_ms {threshold:.0f} ms is too high for the gap{miss}",
        [
            *d.link_evidence(),
            *d.gap_error_evidence(),
            Evidence(query=THRESHOLD, value=threshold, threshold=ceiling, note="live threshold, ms (ceiling: the gap target less a positive prediction error)"),
        ],
    )


def _p_rld_md(d: Judge) -> Cause | None:
    if d.active(WAN_DEGRADATION, RLD_OVERLOAD, RELAY_SATURATED):
        return None
    use = f.relay_cap_use(d.snap, d.config, d.knobs.handoff)
    cap = f.relay_cap_now(d.snap, d.config, d.knobs.handoff)
    mode = d.knobs.handoff.mode
    if use is not None and use >= RELAY_AT_CAP:
        why = f"relays run to their cap ({d.snap.relay_tokens_p90:.0f} tokens p90 of {cap} at RLD's load): RLD stops before MD holds the KV"
    elif mode is HandoffMode.one_shot:
        why = "one-shot handoffs: the stream waits while MD recomputes every relayed token"
    else:
        why = f"relays end before their cap and handoffs go {mode.value}: no handoff knob explains it"
    load = f.role_load(d.snap, d.config, RoleName.relay_decode)
    return (
        why,
        [
            Evidence(
                query=d.q("relay_tokens_p90"),
                value=d.snap.relay_tokens_p90,
                threshold=RELAY_AT_CAP * cap,
                note=f"relay tokens p90; the cap at RLD's load is {cap}",
            ),
            Evidence(query="ongoing / (healthy x max_num_seqs)", value=load, note="RLD load"),
            Evidence(query="handoff.mode", value=None, note=mode.value),
        ],
    )


def _other(d: Judge) -> Cause | None:
    return "no knob of the agents' shapes this pipeline's gaps", []


CAUSES: dict[str, Callable[[Judge], Cause | None]] = {f.P_MD: _p_md, f.P_RLD_MD: _p_rld_md}
