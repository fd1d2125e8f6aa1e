"""Diagnose: name the situations a Snapshot shows (agents/situations.py), each with its
evidence (query + value). `streak` counts consecutive active ticks; the guard acts only
once a situation has lasted `agents.confirm_ticks`.

The SLO objectives' breaches are checked in agents/breaches.py, knobs' returns to the
config's values in agents/intent.py; agents/judge.py holds what every check shares.
"""

from __future__ import annotations

from agents import figures as f
from agents.breaches import objectives
from agents.controllers import gap_threshold_ceiling, raise_within
from agents.intent import returns
from agents.judge import Judge
from agents.knobs import get_knob, knob_bounds, replica_target
from agents.memory import Memory
from agents.situations import (
    BATHTUB_VALLEY,
    GAP_ROOM,
    HIT_GAP,
    IDLE_LOAD,
    LEASE_EXCESS,
    LEASE_LEAK,
    LEASE_SLACK,
    LEASES_GONE,
    MD_HIT_BEHIND,
    OVER_PROVISIONED,
    OVER_SCORE,
    PREFILL_RELAYING,
    RELAY_LOAD,
    RELAY_SATURATED,
    REPLICA_CRASH,
    RLD_LOAD,
    RLD_OVERLOAD,
    VALLEY_GAP,
    VALLEY_SHARE,
    WAN_DEGRADATION,
    WAN_FAILURES,
    WAN_SATURATED,
    WAN_SLOWDOWN,
    Evidence,
    Situation,
)
from app.config import AgentsConfig, LiveKnobs, PDDConfig, RoleName
from app.telemetry.snapshot import Snapshot

THRESHOLD = "routing.max_wan_transfer_ms"


class _Diagnosis(Judge):
    def run(self) -> list[Situation]:
        # the SLO objectives come after the RLD, WAN and valley checks, since a gap breach is not named
        # where one of those explains it (agents/breaches.py); returns to intent last, once every
        # situation that could hold a knob away from its intent is known (agents/intent.py)
        for check in (self.rld, self.saturation, self.hit, self.wan, self.valley, self.slo, self.leases, self.crash, self.prefill_relaying, self.intent):
            check()
        if not any(s.severity for s in self.found):
            self.spare()
        for s in self.found:
            s.streak = self.memory.streaks.get(s.key, 0) + 1
        return self.found

    def slo(self) -> None:
        objectives(self)

    def intent(self) -> None:
        returns(self)

    def rld(self) -> None:
        if self.config.roles.relay_decode is None:
            return
        load = f.role_load(self.snap, self.config, RoleName.relay_decode)
        if self.relay_saturated(load):
            return
        if self.past(RLD_OVERLOAD, load, RLD_LOAD):
            self.add(
                RLD_OVERLOAD,
                f"relay decoders {load:.0%} busy",
                [
                    *self.rld_evidence(),
                    Evidence(query="ongoing / (healthy x max_num_seqs)", value=load, threshold=RLD_LOAD[0]),
                    Evidence(query=self.q("relay_tokens_p90"), value=self.snap.relay_tokens_p90, note="relay tokens p90"),
                ],
                severity=2,
                figure=load,
            )

    def rld_evidence(self) -> list[Evidence]:
        dep = f.deployment(RoleName.relay_decode)
        return [
            Evidence(query=self.q("ongoing_by_deployment"), value=self.snap.ongoing_by_deployment.get(dep), note=f"{dep} requests in progress"),
            Evidence(query=self.q("replicas_healthy_by_deployment"), value=self.snap.replicas_healthy_by_deployment.get(dep), note=f"healthy {dep} replicas"),
        ]

    def relay_saturated(self, load: float | None) -> bool:
        """RLD at `routing.max_relay_load` while P-MD's gaps have room: the WAN threshold is too low.

        Named instead of rld_overload, not beside it: on the same RLD load, rld_overload's remedies
        (shorter relays, a relay replica) cost gap or money, while a higher threshold moves the turns
        with the shortest predicted gaps to P-MD, which P-MD's measured gaps say it can take (at the
        relay's limit routing already sends requests P-MD, in arrival order rather than by gap). Left
        to rld_overload where routing cannot raise the threshold: at its bound or at the gap target
        less the prediction error, or on a link not as configured (wan_degradation's to hold it low).
        """
        limit = get_knob(self.knobs, "routing.max_relay_load")
        share = load / limit if load is not None else None
        room = f.gap_ratio(self.snap, self.config.slo, f.P_MD)
        if not (self.past(RELAY_SATURATED, share, RELAY_LOAD) and self.below(RELAY_SATURATED, room, GAP_ROOM)):
            return False
        bounds = knob_bounds(self.agents, self.config, THRESHOLD)
        threshold = get_knob(self.knobs, THRESHOLD)
        ceiling = gap_threshold_ceiling(self.config.slo.max_gap_ms, f.gap_error_s(self.snap))
        if bounds is None or raise_within(THRESHOLD, threshold, ceiling, bounds) is None or not self.link_as_configured():
            return False
        target = self.config.slo.max_gap_ms
        gap = self.snap.gap_p99_by_pipeline[f.P_MD]
        self.add(
            RELAY_SATURATED,
            f"relay decoders {load:.0%} busy, at routing.max_relay_load {limit:.0%}, while P-MD's worst-gap p99 is "
            f"{gap * 1000:.0f} ms of the {target:.0f} ms target: routing.max_wan_transfer_ms {threshold:.0f} ms is too low",
            [
                *self.rld_evidence(),
                Evidence(query="ongoing / (healthy x max_num_seqs)", value=load, threshold=limit, note="RLD load; threshold: routing.max_relay_load"),
                Evidence(query=self.q("gap_p99_by_pipeline"), value=gap, threshold=GAP_ROOM[0] * target / 1000, note="P-MD worst-gap p99 seconds"),
                *self.link_evidence(),
                *self.gap_error_evidence(),
                Evidence(
                    query=THRESHOLD, value=threshold, threshold=ceiling, note="live threshold, ms (ceiling: the gap target less a positive prediction error)"
                ),
            ],
            severity=2,
            figure=share,
        )
        return True

    def saturation(self) -> None:
        for link in f.wan_links(self.snap, self.config):
            if not self.past(f"{WAN_SATURATED}:{link.link}", link.lease_gone_ratio, LEASES_GONE):
                continue
            bandwidth = f"{link.bandwidth_mbps:g} Mbit/s"
            self.add(
                WAN_SATURATED,
                f"{link.link}: KV fills {link.utilisation:.0%} of its {bandwidth}; "
                f"{link.lease_gone_ratio:.0%} of pulls waited past their lease (the decoder recomputes those prompts)",
                [
                    Evidence(
                        query=f"{self.q('kv_lease_gone_rate_by_link')} / {self.q('kv_transfer_rate_by_link')}",
                        value=link.lease_gone_ratio,
                        threshold=LEASES_GONE[0],
                        note="pulls whose lease expired while they waited",
                    ),
                    Evidence(
                        query=f"{self.q('kv_transfer_rate_by_link')} x {self.q('kv_bytes_per_transfer_by_link')} x 8 / bandwidth",
                        value=link.utilisation,
                        note=f"{link.link} utilisation of {bandwidth}",
                    ),
                    Evidence(
                        query=self.q("kv_slowdown_mean_by_link"),
                        value=link.slowdown,
                        note="pull time / the link model's: near 1, the link itself is as configured",
                    ),
                    Evidence(query=self.q("kv_seconds_p90_by_link"), value=link.p90_s, note="pull seconds p90"),
                ],
                subject=link.link,
                figure=link.lease_gone_ratio,
            )

    def hit(self) -> None:
        gap = f.hit_gap(self.snap)
        if any(s.name == WAN_SATURATED for s in self.found):
            return  # MD's warm-up pulls wait on the full link: more MD cache would not raise its hit
        if self.past(MD_HIT_BEHIND, gap, HIT_GAP):
            self.add(
                MD_HIT_BEHIND,
                f"MD prefix hit trails P's by {gap:.0%}",
                [
                    Evidence(query=self.q("prefix_hit_by_role"), value=self.snap.prefix_hit_by_role.get("prefill"), note="prefill"),
                    Evidence(query=self.q("prefix_hit_by_role"), value=self.snap.prefix_hit_by_role.get("main_decode"), note="main_decode"),
                    Evidence(query="P hit - MD hit", value=gap, threshold=HIT_GAP[0]),
                    Evidence(query=self.q("singular_rate"), value=self.snap.singular_rate, note="singular requests/s"),
                ],
                figure=gap,
            )

    def wan(self) -> None:
        for link in f.wan_links(self.snap, self.config):
            key = f"{WAN_DEGRADATION}:{link.link}"
            slow = self.past(key, link.slowdown, WAN_SLOWDOWN)
            failing = self.past(key, link.failure_ratio, WAN_FAILURES)
            if not (slow or failing):
                continue
            if link.shared:
                model = [
                    Evidence(
                        query=self.q("kv_slowdown_mean_by_link"),
                        value=link.slowdown,
                        threshold=WAN_SLOWDOWN[0],
                        note="mean of each pull's seconds / what the configured link needs for it beside the pulls sharing it",
                    )
                ]
            else:
                model = [
                    Evidence(
                        query="link model: rtt + mean jitter and stall + bytes per pull / bandwidth",
                        value=link.expected_s,
                        note="expected seconds on an idle link",
                    ),
                    Evidence(query="observed / expected", value=link.slowdown, threshold=WAN_SLOWDOWN[0]),
                ]
            self.add(
                WAN_DEGRADATION,
                f"{link.link}: pulls {link.slowdown:.1f}x slower than the link model, {link.failure_ratio:.0%} failing",
                [
                    Evidence(query=self.q("kv_seconds_mean_by_link"), value=link.observed_s, note=f"{link.link} mean pull seconds"),
                    *model,
                    Evidence(query="failures / pulls", value=link.failure_ratio, threshold=WAN_FAILURES[0]),
                    Evidence(query=self.q("gap_p99"), value=self.snap.gap_p99, note="worst-gap p99 seconds"),
                ],
                subject=link.link,
                severity=2,
            )

    def valley(self) -> None:
        share = f.valley_share(self.snap)
        gap = self.snap.gap_p99_by_pipeline.get(f.P_MD)
        ratio = gap * 1000 / self.config.slo.max_gap_ms if gap is not None else None
        if self.past(BATHTUB_VALLEY, share, VALLEY_SHARE) and self.past(BATHTUB_VALLEY, ratio, VALLEY_GAP):
            self.add(
                BATHTUB_VALLEY,
                f"{share:.0%} of requests sit in the hit-rate valley {f.VALLEY[0]:.0%}-{f.VALLEY[1]:.0%} and P-MD gaps are long",
                [
                    Evidence(query=self.q("md_hit_buckets"), value=share, threshold=VALLEY_SHARE[0], note="share of MD hits in the valley"),
                    Evidence(query=self.q("gap_p99_by_pipeline"), value=gap, threshold=self.config.slo.max_gap_ms / 1000, note="P-MD worst-gap p99 seconds"),
                ],
                severity=2,
                figure=share,
            )

    def leases(self) -> None:
        live, slope = self.snap.leases_live, self.snap.leases_slope
        if live is None:
            return
        recent = self.snap.requests_in_lease_window
        if recent is None:  # a source without the count (the twin): the rate over the window
            recent = self.snap.request_rate * self.config.kv.lease_timeout_s
        # a lease lives at most kv.lease_timeout_s: only requests of that span, and those in flight, hold one
        explained = (recent + (self.snap.requests_in_flight or 0.0)) * 1.5 + LEASE_SLACK
        excess = live / explained
        growing = slope is not None and slope > 0
        active = LEASE_LEAK in self.memory.streaks
        if self.past(LEASE_LEAK, excess, LEASE_EXCESS) and (growing or active):
            self.add(
                LEASE_LEAK,
                f"{live:.0f} KV leases live, traffic explains at most {explained:.0f}",
                [
                    Evidence(query=self.q("leases_live"), value=live, threshold=explained),
                    Evidence(query=self.q("leases_slope"), value=slope, note="leases per second"),
                    Evidence(query=self.q("requests_in_lease_window"), value=self.snap.requests_in_lease_window, note="requests in the last lease timeout"),
                    Evidence(query=self.q("requests_in_flight"), value=self.snap.requests_in_flight, note="requests in flight"),
                ],
                severity=1,
                figure=excess,
            )

    def crash(self) -> None:
        for role in self.config.roles.present():
            dep = f.deployment(role)
            healthy = f.healthy_replicas(self.snap, dep)
            target = self.snap.replicas_target_by_deployment.get(dep)
            fails = self.snap.health_check_failures_by_deployment.get(dep, 0.0)
            key = f"{REPLICA_CRASH}:{dep}"
            short = healthy is not None and target is not None and healthy < target
            starting = self.grown_within(role, self.agents.replica_start_s)
            if fails > 0 or (short and (not starting or key in self.memory.streaks)):
                self.add(
                    REPLICA_CRASH,
                    f"{dep}: {healthy or 0:.0f} of {target or 0:.0f} replicas healthy, {fails:.0f} failed health checks",
                    [
                        Evidence(query=self.q("replicas_healthy_by_deployment"), value=healthy, threshold=target, note=dep),
                        Evidence(query=self.q("replicas_target_by_deployment"), value=target, note=dep),
                        Evidence(query=self.q("health_check_failures_by_deployment"), value=fails, note=dep),
                    ],
                    subject=dep,
                    severity=2,
                )

    def prefill_relaying(self) -> None:
        """P relays (P-P-MD) for want of a live relay decoder, or the window still holds requests it relayed."""
        rld = f.deployment(RoleName.relay_decode)
        healthy = f.healthy_replicas(self.snap, rld)
        relays_now = self.config.roles.relay_decode is not None and get_knob(self.knobs, "routing.prefill_relays") and healthy == 0
        relayed = self.snap.request_rate_by_pipeline.get(f.P_P_MD, 0.0)
        if not (relays_now or relayed > 0):
            return
        share = relayed / self.snap.request_rate if relayed > 0 else 0.0
        summary = (
            f"no relay decoder alive: prefill relays ({f.P_P_MD}), {share:.0%} of the window's requests so far"
            if relays_now
            else f"{share:.0%} of the window's requests went {f.P_P_MD} while no relay decoder was alive"
        )
        self.add(
            PREFILL_RELAYING,
            summary,
            [
                Evidence(query=self.q("replicas_healthy_by_deployment"), value=healthy, note=rld),
                Evidence(query=self.q("request_rate_by_pipeline"), value=relayed, note=f"{f.P_P_MD} requests/s"),
            ],
            severity=0,
            figure=share,
        )

    def grown_within(self, role: RoleName, seconds: float) -> bool:
        """Whether the agents added a replica of `role` in the last `seconds`."""
        grown_at = self.memory.raised.get(replica_target(role))
        return grown_at is not None and self.now - grown_at < seconds

    def spare(self) -> None:
        score = f.slo_score(f.slo_figures(self.snap, self.config.slo))
        if self.snap.request_rate <= 0 or not self.below(OVER_PROVISIONED, score, OVER_SCORE):
            return
        idle = []
        for role in self.config.roles.present():
            load = f.role_load(self.snap, self.config, role)
            healthy = self.snap.replicas_healthy_by_deployment.get(f.deployment(role), 0)
            # a replica just added has not drawn its share yet (conversations stay where their cache is)
            settling = self.grown_within(role, self.agents.replica_start_s + self.agents.cooldown_s)
            if load is not None and load < IDLE_LOAD and healthy > 1 and not settling:
                idle.append((role, load))
        if idle:
            self.add(
                OVER_PROVISIONED,
                f"SLO score {score:.2f}; idle roles: {', '.join(f'{r.value} {load:.0%}' for r, load in idle)}",
                [
                    Evidence(query="max(figure / target) over ttft, tpot, gap", value=score, threshold=OVER_SCORE[0]),
                    *(Evidence(query=self.q("ongoing_by_deployment"), value=load, threshold=IDLE_LOAD, note=f"{r.value} load") for r, load in idle),
                ],
                severity=0,
            )


def diagnose(snap: Snapshot, config: PDDConfig, agents: AgentsConfig, knobs: LiveKnobs, memory: Memory, now: float) -> tuple[list[Situation], dict[str, int]]:
    """The situations now, and the streaks to remember (inactive situations drop out)."""
    found = _Diagnosis(snap, config, agents, knobs, memory, now).run()
    return found, {s.key: s.streak for s in found}
