"""`pdd status`: the cluster at a glance, from GET /pdd/state and Prometheus.

The same figures the agents read (app/telemetry/snapshot.py's snapshot), beside the
SLO targets, in green when met and red when not. Without Prometheus the recent
figures the conductor keeps itself are shown instead.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import httpx
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from app.api.auth import local_key
from app.config import PDDConfig
from app.ops.exposure import Exposure, Row, live_engines, probed_api
from app.ops.exposure import render as render_exposure
from app.telemetry.observability import APP_NAME, query_set


def api_headers() -> dict[str, str]:
    """The bearer header for our API: PDD_API_KEY, else the key the app generated on this machine."""
    key = local_key()
    return {"authorization": f"Bearer {key}"} if key else {}


def fetch_state(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    resp = httpx.get(f"{url}/pdd/state", headers=api_headers(), timeout=timeout_s)
    if resp.status_code != 200:
        raise RuntimeError(f"GET {url}/pdd/state: HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def status_without_key(url: str, timeout_s: float = 5.0) -> int | None:
    """The HTTP status GET /v1/models answers a caller with no key (None: no answer)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None


def fetch_snapshot(prometheus_url: str, config: PDDConfig, app_name: str = APP_NAME):
    from app.telemetry.snapshot import PromSource

    return PromSource(prometheus_url, query_set(config, app_name)).snapshot(time.time())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _judged(value_ms: float | None, target_ms: float) -> str:
    if value_ms is None:
        return "-"
    colour = "green" if value_ms <= target_ms else "red"
    return f"[{colour}]{value_ms:.0f}[/{colour}]"


def render(state: dict[str, Any], snapshot: Any | None, prometheus_note: str = "") -> Group:
    targets = state["slo"]["targets"]
    pct = f"p{targets['percentile']:g}"
    header = f"[bold]{state['model']}[/bold]  mode [bold]{state['mode']}[/bold]  in flight {state['in_flight']}"
    saved_at = state.get("prefix_index_saved_at")
    if saved_at is not None:
        header += f"  prefix index saved {max(0.0, time.time() - saved_at):.0f} s ago"

    roles = Table(title="roles", expand=True)
    # "KV blocks known": what the conductor routes on (blocks it knows each replica holds), of the replicas' capacity
    for col in ("role", "datacenter", "device", "replicas", "in flight", "KV blocks known"):
        roles.add_column(col, no_wrap=col in ("role", "datacenter"))
    for name, r in state["roles"].items():
        live = len(r["replicas"])
        want = r["configured_replicas"]
        replicas = f"{live}/{want}" if live == want else f"[red]{live}/{want}[/red]"
        in_flight = sum(x["in_flight"] for x in r["replicas"])
        # MD warm-ups outlive the relayed requests that started them: streams without a client
        warming = sum(x["warming"] for x in r["replicas"])
        known = sum(x["known_blocks"] for x in r["replicas"])
        capacity = sum(x["kv_blocks"] for x in r["replicas"])
        roles.add_row(
            name,
            r["datacenter"],
            r["accelerator"],
            replicas,
            f"{in_flight} ({warming} warm-ups)" if warming else str(in_flight),
            f"{_count(known)} of {_count(capacity)}",
        )

    links = Table(title="links", expand=True)
    for col in ("direction", "Mbit/s", "RTT ms", "KV moved", "state"):
        links.add_column(col)
    for name, link in sorted(state["links"].items()):
        moved = link["bytes_down"]
        links.add_row(name, f"{link['bandwidth_mbps']:g}", f"{link['rtt_ms']:g}", _bytes(moved), "[red]CUT[/red]" if link["is_cut"] else "up")

    slo = Table(title=f"SLOs ({pct}; targets TTFT {targets['ttft_ms']:g} ms, TPOT {targets['tpot_ms']:g} ms, gap {targets['max_gap_ms']:g} ms)", expand=True)
    for col in ("pipeline", "req/s" if snapshot is not None else "requests", f"TTFT {pct} ms", "TTFT p99 ms", f"TPOT {pct} ms", "worst gap p99 ms"):
        slo.add_column(col)
    if snapshot is not None:
        for p in sorted(set(snapshot.request_rate_by_pipeline) | set(snapshot.ttft_p_by_pipeline)):
            slo.add_row(
                p,
                _rate(snapshot.request_rate_by_pipeline.get(p, 0)),
                _judged(_sec_ms(snapshot.ttft_p_by_pipeline.get(p)), targets["ttft_ms"]),
                _ms(snapshot.ttft_p99_by_pipeline.get(p)),
                _judged(_sec_ms(snapshot.tpot_p_by_pipeline.get(p)), targets["tpot_ms"]),
                _judged(_sec_ms(snapshot.gap_p99_by_pipeline.get(p)), targets["max_gap_ms"]),
            )
    else:
        for p, fig in state["slo"]["recent"]["by_pipeline"].items():  # the conductor keeps p50/p90/p99 and the SLO's
            p99 = fig["ttft_ms"]["p99"]
            slo.add_row(
                p,
                str(fig["requests"]),
                _judged(fig["ttft_ms"][pct], targets["ttft_ms"]),
                "-" if p99 is None else f"{p99:.0f}",
                _judged(fig["tpot_ms"][pct], targets["tpot_ms"]),
                _judged(fig["max_gap_ms"]["p99"], targets["max_gap_ms"]),
            )

    extra = []
    if snapshot is not None:
        hits = ", ".join(f"{role} {v:.0%}" for role, v in sorted(snapshot.prefix_hit_by_role.items())) or "-"
        wan = ", ".join(f"{link} {_ms(v)} ms" for link, v in sorted(snapshot.kv_seconds_p90_by_link.items())) or "-"
        extra.append(f"prefix hit: {hits}   KV pull p90: {wan}   leases held: {snapshot.leases_live if snapshot.leases_live is not None else '-'}")
    extra.append(f"model runner: {_runners(state['roles'])}")
    knobs = state["knobs"]
    extra.append(
        f"knobs: max_wan_transfer_ms {knobs['routing']['max_wan_transfer_ms']:g}, handoff {knobs['handoff']['mode']} "
        f"(catch-up > {knobs['handoff']['catch_up_threshold_tokens']}, relay cap {knobs['handoff']['relay_cap_tokens']})"
    )
    if prometheus_note:
        extra.append(f"[yellow]{prometheus_note}[/yellow]")
    return Group(Panel(header), roles, links, slo, *extra)


def _runners(roles: dict[str, Any]) -> str:
    """The vLLM model runners the live engines built: one label when all agree, else per role."""
    by_role = {name: sorted({x.get("model_runner") or "?" for x in r["replicas"]}) for name, r in roles.items() if r["replicas"]}
    labels = {label for found in by_role.values() for label in found}
    if len(labels) == 1:
        return f"{labels.pop()} on every engine"
    return ", ".join(f"{name} {' / '.join(found)}" for name, found in by_role.items()) or "- (no engine up)"


def _count(n: int) -> str:
    """1,234 below 10,000; then 12.3k, 1.98M: a cell an 80-column terminal keeps on one line."""
    if n < 10_000:
        return f"{n:,}"
    return f"{n / 1e3:.1f}k" if n < 1_000_000 else f"{n / 1e6:.3g}M"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _rate(per_s: float) -> str:
    """Two decimals, or two significant digits below 0.1/s (a quiet app's 0.0083 is not 0.00)."""
    return f"{per_s:.2f}" if per_s >= 0.1 or per_s == 0 else f"{per_s:.2g}"


def _sec_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def show(
    url: str, prometheus_url: str, config: PDDConfig, console: Console, app_name: str = APP_NAME, as_json: bool = False, exposure: Exposure | None = None
) -> None:
    """`pdd status`: the table, or with `as_json` the state, Prometheus' figures (null when
    not shown) and the note saying why, as one JSON object for scripts. With `exposure` (the
    config's listeners), the engines' live addresses and the API's answer to a keyless call too."""
    state = fetch_state(url)
    if exposure is not None:
        exposure.rows += [
            Row("public API, as reached from here", url, probed_api(status_without_key(url))),
            Row("engines live", "", ""),
            *live_engines(state, config),
        ]
    try:
        snapshot, note = figures_to_show(state, fetch_snapshot(prometheus_url, config, app_name))
    except Exception as err:  # noqa: BLE001 - the state alone is still worth showing
        snapshot, note = None, f"Prometheus unavailable ({str(err)[:120]}); figures below are the conductor's last {state['slo']['recent']['window_s']:g} s"
    if as_json:
        figures = None if snapshot is None else snapshot.model_dump(mode="json")
        console.print_json(data={"state": state, "prometheus": figures, "note": note, "exposure": None if exposure is None else asdict(exposure)})
    else:
        console.print(render(state, snapshot, note))
        if exposure is not None:
            console.print(render_exposure(exposure))


def figures_to_show(state: dict[str, Any], snapshot: Any) -> tuple[Any | None, str]:
    """Prometheus' figures, or the conductor's own while Prometheus has no request rate
    although the conductor served requests: a rate needs two scrapes of a series, so the
    requests before a series' first scrape (a new app's first ones) never show in it."""
    served = state["slo"]["recent"]["by_pipeline"]
    if served and not any(rate > 0 for rate in snapshot.request_rate_by_pipeline.values()):
        return None, (
            f"Prometheus shows no request rate yet (it counts from a series' second scrape); "
            f"figures below are the conductor's last {state['slo']['recent']['window_s']:g} s"
        )
    return snapshot, ""
