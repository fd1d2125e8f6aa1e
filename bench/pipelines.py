"""colocated vs pd_intra_dc vs pd_cross_dc_naive vs pdd on real engines, emulated WAN.

One app (P + RLD in dc-a, MD in dc-b) serves the same agentic trace once per
mode, from cold caches each time: multi-turn sessions with long contexts for
this machine, most turns above 95% prefix hit, a low-hit tail of a few percent
(app/sim/workload.py generates it). Each session is an agent: a turn goes out at
its arrival time or when the previous turn's answer is complete, whichever is
later, and its prompt repeats the conversation so far (previous prompt and the
answer's token ids, `return_token_ids`) before the new tokens. Measured at the
client (official openai client, streaming). Each mode's trace, with the times
requests really went out, is written to bench/out/pipelines_trace_MODE.jsonl for
the twin to replay (bench/sim_vs_real.py).

Before each mode's measured run, a calibration replay (another seed, as many
requests unless `--calibration-requests` says otherwise: with 40, the engines
stepped faster than in the 120-request run, whose WAN backlog and link
emulation grow over time; its arrivals scaled to the run's rate of requests,
so it offers the same load: `calibration_trace`) serves that mode while every engine times its steps
(`engine.record_steps`, app/engine/kv/steps.py); they go to
bench/out/pipelines_steps_MODE.json, to which bench/sim_vs_real.py scales the
twin's step model: steps of the loaded app, taken minutes before the run it is
checked against, none of them from that run. With them goes each calibration
request's serving overhead: its TTFT at the conductor less the engine
replicas' own (app/sim/fitting.py `serving_overhead_ms`), and the requests
in flight when it arrived, as the overhead grows with them; each decoder
replica's own time on its request (`decoder_request_overheads`); and each KV
pull inside a datacenter, less its link's own time (`kv_pulls`: the
transport's cost). The measured run's own steps, overheads and pulls go to
bench/out/pipelines_steps_MODE_run.json (for sim_vs_real's in-sample check),
and its requests' journeys (GET /pdd/requests/{id}: pipeline, transfers,
handoff, engine timings) to bench/out/pipelines_journeys_MODE.json.

Two worst-case latency figures per request:
- worst gap: the longest wait between two tokens after the first;
- worst wait: the longest time the client waits for its next token, the first
  one included (max of TTFT and worst gap). Naive cross-DC PD hides its WAN
  transfer in TTFT, PDD in a relay: only this figure compares the two.

    python bench/pipelines.py [--requests 120] [--rps 1.0] [--calibration-requests N] [--json out.json] [--gpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from rich.console import Console
from rich.table import Table

from app.config import PDDConfig
from app.config.file import parse_config
from app.ops import progress
from app.ops.faults import Faults
from app.sim.calibrate import take_app_steps
from app.sim.fitting import decoder_request_overheads, kv_pulls, serving_overhead_ms, serving_overheads
from app.sim.run import scaled
from app.sim.workload import AgenticWorkload, HitBand, Request, write_trace
from bench.common import OUT_DIR, LoadResult, LocalApp, RequestRecord, percentile, wait_http, write_outputs
from tests.conftest import local_args, on_one_gpu, set_wan

console = Console(width=160)
MODES = ("colocated", "pd_intra_dc", "pd_cross_dc_naive", "pdd")
WAN = "dc-a->dc-b"


def trace_path(mode: str) -> Path:
    """Where a mode's trace as sent is written."""
    return OUT_DIR / f"pipelines_trace_{mode}.jsonl"


def steps_path(mode: str, run: str = "calibration") -> Path:
    """Where the steps the engines timed during a mode's calibration replay (or its measured run) are written."""
    return OUT_DIR / (f"pipelines_steps_{mode}.json" if run == "calibration" else f"pipelines_steps_{mode}_{run}.json")


def write_steps(path: Path, journeys: list[dict], config: PDDConfig) -> None:
    """The steps the app's engines timed since the last take, by role, the
    serving overhead of each of `journeys` that has one, with the requests in
    flight when it arrived (app/sim/fitting.py `serving_overheads`), the
    decoder replicas' own time on their requests (`decoder_request_overheads`)
    and their KV pulls inside a datacenter (`kv_pulls`)."""
    steps = take_app_steps("pipelines")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "roles": {role.value: [s.__dict__ for s in samples] for role, samples in steps.items()},
                "serving_overheads": [sample._asdict() for sample in serving_overheads(journeys)],
                "decoder_request_overheads": decoder_request_overheads(journeys),
                "kv_pulls": [sample._asdict() for sample in kv_pulls(journeys, config)],
            }
        )
    )


def journeys_path(mode: str) -> Path:
    """Where the journeys of a mode's measured run are written."""
    return OUT_DIR / f"pipelines_journeys_{mode}.json"


def fetch_journeys(base_url: str, ids: list[str]) -> list[dict]:
    """The conductor's journeys of these requests ({} where a request got no id)."""
    return [httpx.get(f"{base_url}/pdd/requests/{rid}", timeout=30).json() if rid else {} for rid in ids]


def workload(requests: int, rps: float, seed: int) -> AgenticWorkload:
    """The agentic mix of the PDD paper, scaled to contexts this machine serves in seconds."""
    return AgenticWorkload(
        requests=requests,
        rps=rps,
        seed=seed,
        turns_min=20,
        turns_max=30,
        first_prompt_median=1200,
        first_prompt_sigma=0.3,
        max_context_tokens=6000,
        compact_to=0.5,
        hit_bands=[HitBand(weight=0.75, low=0.95, high=1.0), HitBand(weight=0.21, low=0.6, high=0.95), HitBand(weight=0.04, low=0.0, high=0.5)],
        output_median=48,
        output_sigma=0.5,
        output_max=160,
        think_time_min_s=2.0,
        think_time_mean_s=4.0,
    )


async def replay(base_url: str, trace: list[Request], mode: str, seed: int, step: progress.Step) -> tuple[LoadResult, list[str], list[Request]]:
    """Sessions run as agents (turns in order); returns results, request ids and the trace as sent.
    `step(name)` as each request ends."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    records: list[RequestRecord | None] = [None] * len(trace)
    ids: list[str] = [""] * len(trace)
    sent: list[Request | None] = [None] * len(trace)
    sessions: dict = {}
    for i, r in enumerate(trace):
        sessions.setdefault(r.session, []).append(i)
    t0 = time.perf_counter()
    done = 0

    async def one(i: int, conversation: list[int], rng: random.Random) -> list[int]:
        r = trace[i]
        keep = min(r.prefix_tokens, len(conversation), r.prompt_tokens - 1)
        prompt = conversation[:keep] + [rng.randrange(10, 500) for _ in range(r.prompt_tokens - keep)]
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        start = time.perf_counter()
        sent[i] = r._replace(arrival_s=start - t0, prefix_tokens=keep)
        first = last = None
        gaps, tokens, output = [], 0, []
        try:
            # The token ids go in extra_body, which the SDK sends as is: as `prompt` it walks
            # every id in Python first (13-22 us each here: 65-110 ms of CPU for a 5000-token
            # prompt, taken from the engines under test while it blocks this event loop, so
            # every other stream's next token reaches the client late)
            stream = await client.completions.create(
                model="pdd-dev",
                prompt="",
                max_tokens=r.output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"prompt": prompt, "ignore_eos": True, "pdd_mode": mode, "return_token_ids": True},
            )
            async for chunk in stream:
                ids[i] = chunk.id
                now = time.perf_counter()
                if chunk.choices:
                    output += chunk.choices[0].token_ids or []
                    if chunk.choices[0].text:
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            records[i] = RequestRecord((first or end) - start, end - start, tokens, gaps)
        except Exception as exc:  # noqa: BLE001 - a failure is a data point
            records[i] = RequestRecord(float("nan"), time.perf_counter() - start, 0, error=f"{type(exc).__name__}: {exc}")
        return prompt + output

    async def session(turns: list[int]) -> None:
        nonlocal done
        rng = random.Random(seed * 1_000_003 + turns[0])
        conversation: list[int] = []
        for i in turns:
            conversation = await one(i, conversation, rng)
            done += 1
            step(f"{mode} {done}/{len(trace)}")

    await asyncio.gather(*(session(turns) for turns in sessions.values()))
    await client.close()
    return LoadResult(mode, 0, time.perf_counter() - t0, [r for r in records if r is not None]), ids, [r for r in sent if r is not None]


def calibration_trace(requests: int, rps: float, seed: int, span_s: float) -> list[Request]:
    """Another trace of the workload, its arrivals stretched or squeezed to span `span_s`.

    Agents wait for each answer, so how many sessions a seed draws sets the real
    load more than `rps` does: seed 1 spreads 120 requests over 85 s, seed 1001
    over 198 s, and at that half load P stepped 1.4x slower than alone against
    1.9x in the run. At the run's rate of requests, both offer about the same load.
    """
    trace = list(workload(requests, rps, seed).generate())
    return list(scaled(trace, trace[-1].arrival_s / span_s)) if span_s > 0 and trace[-1].arrival_s > 0 else trace


def calibrate(base_url: str, mode: str, trace: list[Request], seed: int, config: PDDConfig, step: progress.Step) -> None:
    """Serve `mode` a calibration trace from cold caches; write the steps the engines timed (since the last take)."""
    from ray import serve

    serve.get_deployment_handle("Conductor", app_name="pipelines").reset_prefix_caches.remote().result()
    _, ids, _ = asyncio.run(replay(base_url, trace, mode, seed, lambda name: step(f"calibration {name}")))
    write_steps(steps_path(mode), fetch_journeys(base_url, ids), config)


def worst_wait_ms(result: LoadResult, q: float) -> float:
    return percentile([max(r.ttft_s, r.max_gap_s) for r in result.ok], q) * 1000


def bench_args(gpu: bool = False) -> dict:
    """The app config this benchmark serves (bench/sim_vs_real.py simulates the same). On a
    CUDA machine: every engine on the one GPU, dummy weights of an 8B Llama shape, and a
    datacenter-class WAN (8B KV is 128 KiB/token: 10 Gbit/s is the WAN share)."""
    args = local_args()
    args["model"]["max_model_len"] = 8192
    if gpu:
        set_wan(on_one_gpu(args), 10_000, 30, jitter=True)
    for role in args["roles"].values():
        role.setdefault("engine", {})["record_steps"] = True
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rps", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--calibration-requests",
        type=int,
        default=None,
        help="requests of the calibration replay before each mode's run (default: as many as --requests; 0: none)",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gpu", action="store_true", help="CUDA vllm, 8B-shaped dummy model")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    if a.calibration_requests is None:
        a.calibration_requests = a.requests
    modes = a.modes.split(",")

    args = bench_args(a.gpu)
    config = parse_config(args)
    trace = list(workload(a.requests, a.rps, a.seed).generate())
    hits = [r.prefix_tokens / r.prompt_tokens for r in trace]
    console.print(
        f"trace: {len(trace)} requests in {len({r.session for r in trace})} sessions over {trace[-1].arrival_s:.0f} s, "
        f"mean hit {sum(hits) / len(hits):.0%}, {sum(h > 0.95 for h in hits) / len(hits):.0%} above 95%, "
        f"{sum(h < 0.5 for h in hits) / len(hits):.0%} below 50% (first turns included)"
    )

    calibration = []
    if a.calibration_requests:  # at the run's own rate of requests
        calibration = calibration_trace(a.calibration_requests, a.rps, a.seed + 1000, trace[-1].arrival_s * a.calibration_requests / len(trace))
        console.print(
            f"calibration trace: {len(calibration)} requests in {len({r.session for r in calibration})} sessions over "
            f"{calibration[-1].arrival_s:.0f} s (seed {a.seed + 1000}, arrivals scaled to the run's rate)"
        )

    results: dict[str, LoadResult] = {}
    wan: dict[str, int] = {}
    pipelines: dict[str, dict[str, int]] = {}
    journeys: dict[str, list[dict]] = {}
    with LocalApp(args, name="pipelines") as app, progress.steps(console, "requests", len(modes) * (len(trace) + len(calibration))) as step:
        wait_http(f"{app.base_url}/health")
        from ray import serve

        conductor = serve.get_deployment_handle("Conductor", app_name="pipelines")
        for mode in modes:
            take_app_steps("pipelines")  # steps from here on are this mode's (each write_steps takes them too)
            if a.calibration_requests:
                calibrate(app.base_url, mode, calibration, a.seed + 1000, config, step)
            else:
                steps_path(mode).unlink(missing_ok=True)  # an older run's steps would not match this run
            conductor.reset_prefix_caches.remote().result()
            before = Faults("pipelines").link_counters(WAN)["bytes_down"]
            result, ids, sent = asyncio.run(replay(app.base_url, trace, mode, a.seed, step))
            journeys[mode] = fetch_journeys(app.base_url, ids)
            write_steps(steps_path(mode, "run"), journeys[mode], config)
            journeys_path(mode).write_text(json.dumps(journeys[mode]))
            results[mode] = result
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            write_trace(trace_path(mode), sorted(sent))
            wan[mode] = Faults("pipelines").link_counters(WAN)["bytes_down"] - before
            counts: dict[str, int] = {}
            for j in journeys[mode]:
                p = j.get("pipeline") or "?"
                counts[p] = counts.get(p, 0) + 1
            pipelines[mode] = counts

    rows, summary_rows = [], {}
    for mode, r in results.items():
        summary_rows[mode] = {
            "ttft_p50": r.ttft_ms(50),
            "ttft_p90": r.ttft_ms(90),
            "ttft_p99": r.ttft_ms(99),
            "tpot_p50": r.tpot_ms(50),
            "gap_p50": r.gap_ms(50),
            "gap_p99": r.gap_ms(99),
            "wait_p99": worst_wait_ms(r, 99),
            "wan_mb": wan[mode] / 1e6,
            "failed": len(r.records) - len(r.ok),
            "serving_overhead_p50": percentile([x for j in journeys[mode] if (x := serving_overhead_ms(j)) is not None], 50),
        }
        for rec, j in zip(r.records, journeys[mode]):
            decision = j.get("decision") or {}
            rows.append(
                {
                    "mode": mode,
                    "pipeline": j.get("pipeline"),
                    "prompt_tokens": j.get("prompt_tokens"),
                    "ttft_ms": rec.ttft_s * 1000,
                    "server_ttft_ms": j.get("ttft_ms"),
                    "serving_overhead_ms": serving_overhead_ms(j),
                    "max_gap_ms": rec.max_gap_s * 1000,
                    "tpot_ms": rec.tpot_s * 1000,
                    "tokens": rec.completion_tokens,
                    "md_hit_estimate": decision.get("md_hit_estimate"),
                    "expected_wan_ms": decision.get("expected_wan_ms"),
                    "md_hit_tokens": (j.get("hit_tokens") or {}).get("main_decode"),
                    "handoff_latency_ms": (j.get("handoff") or {}).get("latency_ms"),
                    "wan_bytes": sum(t["bytes"] for t in j.get("transfers", []) if t["link"] == WAN),
                    "error": rec.error or "",
                }
            )

    table = Table(title=f"pipelines on real engines: {len(trace)} agentic requests at {a.rps} req/s, same trace per mode, cold caches")
    for col in ("mode", "TTFT p50", "p90", "p99", "TPOT p50", "worst gap p50", "p99", "worst wait p99", "WAN MB", "failed", "pipelines"):
        table.add_column(col, justify="right")
    for mode, s in summary_rows.items():
        table.add_row(
            mode,
            *(f"{s[k]:.0f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99")),
            f"{s['tpot_p50']:.1f}",
            f"{s['gap_p50']:.0f}",
            f"{s['gap_p99']:.0f}",
            f"{s['wait_p99']:.0f}",
            f"{s['wan_mb']:.1f}",
            str(s["failed"]),
            " ".join(f"{k}:{v}" for k, v in sorted(pipelines[mode].items())),
        )
    console.print(table)
    console.print("times in ms; worst wait = max(TTFT, worst inter-token gap) per request")
    console.print(
        "serving overhead p50 (TTFT at the conductor outside the engines' cores): "
        + ", ".join(f"{mode} {s['serving_overhead_p50']:.1f} ms" for mode, s in summary_rows.items())
    )

    summary: dict = {"modes": summary_rows, "pipelines": pipelines, "requests": len(trace), "rps": a.rps}
    if {"pdd", "pd_intra_dc", "pd_cross_dc_naive"} <= set(summary_rows):
        pdd, intra, naive = summary_rows["pdd"], summary_rows["pd_intra_dc"], summary_rows["pd_cross_dc_naive"]
        summary.update(
            gap_p99_pdd_over_intra=pdd["gap_p99"] / intra["gap_p99"],
            gap_p99_naive_over_pdd=naive["wait_p99"] / pdd["wait_p99"],
            ttft_p99_pdd_over_intra=pdd["ttft_p99"] / intra["ttft_p99"],
        )
        console.print(
            f"pdd worst-gap p99 / pd_intra_dc: {summary['gap_p99_pdd_over_intra']:.2f}x (goal <= 1.5x); "
            f"naive / pdd worst-wait p99: {summary['gap_p99_naive_over_pdd']:.1f}x (goal >= 5x); "
            f"pdd TTFT p99 / pd_intra_dc: {summary['ttft_p99_pdd_over_intra']:.2f}x (goal <= 1.1x)"
        )

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for mode, r in results.items():
            for ax, values in ((axes[0], [x.ttft_s * 1000 for x in r.ok]), (axes[1], [max(x.ttft_s, x.max_gap_s) * 1000 for x in r.ok])):
                xs = sorted(values)
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode)
        axes[0].set_title("TTFT CDF")
        axes[1].set_title("worst wait (max of TTFT, inter-token gap) CDF")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("ms")
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("pipelines", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path}, {csv_path.with_suffix('.png')} and {', '.join(str(trace_path(m)) for m in results)}")


if __name__ == "__main__":
    main()
