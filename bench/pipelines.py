"""Six systems on real engines and an emulated WAN: colocated, pd_intra_dc,
pd_cross_dc_naive, pd_cross_dc, pdd without its relay, and pdd.

Each system serves the same agentic trace from cold caches: multi-turn sessions
with long contexts for this machine, most turns above 95% prefix hit, a
low-hit tail of a few percent (app/sim/workload.py generates it). Each session
is an agent: a turn goes out at its arrival time or when the previous turn's
answer is complete, whichever is later, and its prompt repeats the
conversation so far (previous prompt and the answer's token ids,
`return_token_ids`) before the new tokens. Two profiles (`--profile`):
- open: sessions arrive over time and think between turns (the trace's times);
- closed: `--agents` agents (4) at once, each running conversations one after
  another and sending each turn as soon as the last answer ends; outputs a mix
  of short tool calls and long answers.
Measured at the client (official openai client, streaming). `--api` picks how
turns are sent: `completions` (token ids, the default), or as chat
conversations (bench/chat_replay.py): `chat` (user and assistant messages) or
`tools` (short answers are tool calls, the next turn their tool message). The
table's hit columns are the share of each prompt the engines found in their
prefix caches (P's and MD's, from the journeys): a chat replay whose rendering
broke the conversation's prefix would show it there.

What each system is given: every engine of this host shares its two cores, so a
system running more engines is slower for that reason alone. Each
disaggregated system runs three engines (pd_intra_dc: 1 P + 2 decoders in A;
pd_cross_dc and the naive one: 1 P in A + 2 decoders in B; pdd, with or without
relay: 1 P + 1 RLD in A, 1 MD in B) and colocated three replicas of one
engine; the app deploys the roles a system does not use too, idle. The systems
are served by the same app build, engine settings and environment (pdd_mode
per request); pdd without relay is pdd with `routing.max_wan_transfer_ms: 1e9`
set live on the conductor (every turn P-MD, the first token from P).
Each system's trace, with the times requests really went out, is written to
bench/out/pipelines_trace_SYSTEM.jsonl for the twin to replay
(bench/sim_vs_real.py).

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

    python bench/pipelines.py [--profile open|closed] [--api completions|chat|tools] [--requests 120] [--rps 1.0] [--calibration-requests N]
                              [--systems a,b,..] [--json out.json] [--gpu]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from bench.chat_replay import chat_replay
from bench.common import OUT_DIR, LoadResult, LocalApp, Replayed, percentile, replay_sessions, wait_http, write_outputs
from tests.conftest import local_args, on_one_gpu, set_wan

console = Console(width=160)
WAN = "dc-a->dc-b"


@dataclass(frozen=True)
class System:
    mode: str
    """The `pdd_mode` its requests carry."""
    replicas: tuple[tuple[str, int], ...] = ()
    """Role replica counts it is given (the rest as bench_args has them: one each)."""
    routing: tuple[tuple[str, float], ...] = ()
    """Live routing knobs set on the conductor for its run."""
    given: str = ""


SYSTEMS = {
    "colocated": System("colocated", (("main_decode", 3),), given="3 replicas of one engine"),
    "pd_intra_dc": System("pd_intra_dc", (("relay_decode", 2),), given="1 P + 2 D in A"),
    "pd_cross_dc_naive": System("pd_cross_dc_naive", (("main_decode", 2),), given="1 P in A, 2 D in B, whole KV over the WAN"),
    "pd_cross_dc": System("pd_cross_dc", (("main_decode", 2),), given="1 P in A, 2 D in B, D pulls what its cache lacks"),
    "pdd_no_relay": System("pdd", routing=(("max_wan_transfer_ms", 1e9),), given="1 P + 1 RLD in A, 1 MD in B; every turn P-MD"),
    "pdd": System("pdd", given="1 P + 1 RLD in A, 1 MD in B"),
}


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


def fetch_journeys(base_url: str, ids: list[str], timeout_s: float = 60) -> list[dict]:
    """The conductor's journeys of these requests ({} where a request got no id), once every request
    that reached MD has MD's report (its prefix hit: MD still warms up after a relay that ended the request)."""
    deadline = time.monotonic() + timeout_s
    journeys: list[dict] = [{} for _ in ids]
    waiting = [i for i, rid in enumerate(ids) if rid]
    while True:
        for i in waiting:
            journeys[i] = httpx.get(f"{base_url}/pdd/requests/{ids[i]}", timeout=30).json()
        waiting = [i for i in waiting if "MD" in (journeys[i].get("pipeline") or "") and "main_decode" not in (journeys[i].get("hit_tokens") or {})]
        if not waiting or time.monotonic() > deadline:
            return journeys
        time.sleep(1)


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


#: The closed profile's outputs: most turns a short tool call, the rest a long answer.
TOOL_CALL_SHARE = 0.7
TOOL_CALL_TOKENS = (8, 32)
ANSWER_TOKENS = (150, 300)


def closed_trace(requests: int, agents: int, seed: int) -> list[Request]:
    """The workload's conversations, run by `agents` agents at once: each agent holds its
    conversations one after another and sends each turn as soon as the last answer ended
    (arrivals 0); outputs a mix of short tool calls and long answers."""
    rng = random.Random(seed)
    conversations: dict[int | str, list[Request]] = {}
    for r in workload(requests, 1.0, seed).generate():
        low, high = TOOL_CALL_TOKENS if rng.random() < TOOL_CALL_SHARE else ANSWER_TOKENS
        conversations.setdefault(r.session, []).append(r._replace(arrival_s=0.0, output_tokens=rng.randint(low, high)))
    held: list[list[Request]] = [[] for _ in range(agents)]
    for k, turns in enumerate(conversations.values()):
        # a conversation's first turn repeats nothing the agent sent before (as the open replay's first
        # turns, whose conversation is empty): not the agent's previous conversation
        turns[0] = turns[0]._replace(prefix_tokens=0)
        held[k % agents] += [t._replace(session=k % agents) for t in turns]
    return [t for turns in held for t in turns]


def profile_trace(profile: str, requests: int, rps: float, seed: int, agents: int) -> list[Request]:
    return closed_trace(requests, agents, seed) if profile == "closed" else list(workload(requests, rps, seed).generate())


async def replay(base_url: str, trace: list[Request], mode: str, seed: int, step: progress.Step) -> tuple[LoadResult, list[str], list[Request]]:
    """Sessions run as agents (turns in order), each turn's prompt the conversation's token ids;
    returns results, request ids and the trace as sent. `step(name)` as each request ends."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)

    async def one(replayed: Replayed, i: int, conversation: list[int] | None, rng: random.Random) -> list[int]:
        r, conversation = trace[i], conversation or []
        keep = min(r.prefix_tokens, len(conversation), r.prompt_tokens - 1)
        prompt = conversation[:keep] + [rng.randrange(10, 500) for _ in range(r.prompt_tokens - keep)]
        timed = await replayed.begin(i, keep)
        tokens, output = 0, []
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
                replayed.ids[i] = chunk.id
                if chunk.choices:
                    output += chunk.choices[0].token_ids or []
                    if chunk.choices[0].text:
                        timed.token()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            replayed.records[i] = timed.done(tokens)
        except Exception as exc:  # noqa: BLE001 - a failure is a data point
            replayed.records[i] = timed.failed(exc)
        return prompt + output

    try:
        return await replay_sessions(trace, mode, seed, step, one)
    finally:
        await client.close()


Replay = Callable[[str, list[Request], str, int, progress.Step], Awaitable[tuple[LoadResult, list[str], list[Request]]]]


def replayer(api: str) -> Replay:
    """How turns are sent: token ids to completions, or chat conversations (plain or with tool calls)."""
    return replay if api == "completions" else functools.partial(chat_replay, tools=api == "tools")


def calibration_trace(requests: int, rps: float, seed: int, span_s: float, profile: str = "open", agents: int = 4) -> list[Request]:
    """Another trace of the workload, its arrivals stretched or squeezed to span `span_s`.

    Agents wait for each answer, so how many sessions a seed draws sets the real
    load more than `rps` does: seed 1 spreads 120 requests over 85 s, seed 1001
    over 198 s, and at that half load P stepped 1.4x slower than alone against
    1.9x in the run. At the run's rate of requests, both offer about the same load.
    """
    trace = profile_trace(profile, requests, rps, seed, agents)
    return list(scaled(trace, trace[-1].arrival_s / span_s)) if span_s > 0 and trace[-1].arrival_s > 0 else trace


def calibrate(base_url: str, name: str, trace: list[Request], seed: int, config: PDDConfig, step: progress.Step, send: Replay) -> None:
    """Serve system `name` a calibration trace from cold caches; write the steps the engines timed (since the last take)."""
    from ray import serve

    serve.get_deployment_handle("Conductor", app_name="pipelines").reset_prefix_caches.remote().result()
    _, ids, _ = asyncio.run(send(base_url, trace, SYSTEMS[name].mode, seed, lambda label: step(f"calibration {label}")))
    write_steps(steps_path(name), fetch_journeys(base_url, ids), config)


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


def system_args(base: dict, system: System) -> dict:
    args = copy.deepcopy(base)
    for role, replicas in system.replicas:
        args["roles"][role]["replicas"] = replicas
    return args


@contextmanager
def live_routing(system: System, config: PDDConfig) -> Iterator[None]:
    """The system's routing knobs on the conductor for its run (as a user_config update calls
    its reconfigure), the config's own after."""
    from ray import serve

    if not system.routing:
        yield
        return
    conductor = serve.get_deployment_handle("Conductor", app_name="pipelines")
    knobs = config.live_knobs().model_dump(mode="json")
    knobs["routing"].update(dict(system.routing))
    conductor.reconfigure.remote(knobs).result()
    try:
        yield
    finally:
        conductor.reconfigure.remote(config.live_knobs().model_dump(mode="json")).result()


@dataclass
class Served:
    result: LoadResult
    journeys: list[dict]
    wan_bytes: int
    pipelines: dict[str, int]


def serve_system(
    app: LocalApp, name: str, trace: list[Request], calibration: list[Request], a: argparse.Namespace, config: PDDConfig, step: progress.Step
) -> Served:
    from ray import serve

    system = SYSTEMS[name]
    take_app_steps("pipelines")  # steps from here on are this system's (each write_steps takes them too)
    with live_routing(system, config):
        if calibration:
            calibrate(app.base_url, name, calibration, a.seed + 1000, config, step, replayer(a.api))
        else:
            steps_path(name).unlink(missing_ok=True)  # an older run's steps would not match this run
        serve.get_deployment_handle("Conductor", app_name="pipelines").reset_prefix_caches.remote().result()
        before = Faults("pipelines").link_counters(WAN)["bytes_down"]
        result, ids, sent = asyncio.run(replayer(a.api)(app.base_url, trace, system.mode, a.seed, lambda label: step(f"{name}: {label}")))
    journeys = fetch_journeys(app.base_url, ids)
    write_steps(steps_path(name, "run"), journeys, config)
    journeys_path(name).write_text(json.dumps(journeys))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    write_trace(trace_path(name), sorted(sent))
    counts: dict[str, int] = {}
    for j in journeys:
        counts[j.get("pipeline") or "?"] = counts.get(j.get("pipeline") or "?", 0) + 1
    result.label = name
    return Served(result, journeys, Faults("pipelines").link_counters(WAN)["bytes_down"] - before, counts)


def hit_share(journeys: list[dict], role: str) -> float:
    """The mean share of each prompt that `role`'s engine found in its prefix cache (the requests it saw)."""
    shares = [j["hit_tokens"][role] / j["prompt_tokens"] for j in journeys if role in (j.get("hit_tokens") or {}) and j.get("prompt_tokens")]
    return sum(shares) / len(shares) if shares else float("nan")


def summarize(name: str, served: Served) -> dict[str, float]:
    r = served.result
    return {
        "hit_p": hit_share(served.journeys, "prefill"),
        "hit_md": hit_share(served.journeys, "main_decode"),
        "ttft_p50": r.ttft_ms(50),
        "ttft_p90": r.ttft_ms(90),
        "ttft_p99": r.ttft_ms(99),
        "tpot_p50": r.tpot_ms(50),
        "gap_p50": r.gap_ms(50),
        "gap_p99": r.gap_ms(99),
        "wait_p99": worst_wait_ms(r, 99),
        "wan_mb": served.wan_bytes / 1e6,
        "failed": len(r.records) - len(r.ok),
        "serving_overhead_p50": percentile([x for j in served.journeys if (x := serving_overhead_ms(j)) is not None], 50),
    }


def request_rows(name: str, served: Served) -> list[dict]:
    rows = []
    for rec, j in zip(served.result.records, served.journeys):
        decision = j.get("decision") or {}
        rows.append(
            {
                "system": name,
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
                "predicted_gap_ms": decision.get("predicted_gap_ms"),
                "md_gap_ms": j.get("md_gap_ms"),
                "md_hit_tokens": (j.get("hit_tokens") or {}).get("main_decode"),
                "handoff_latency_ms": (j.get("handoff") or {}).get("latency_ms"),
                "wan_bytes": sum(t["bytes"] for t in j.get("transfers", []) if t["link"] == WAN),
                "error": rec.error or "",
            }
        )
    return rows


def ratios(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    """The issue's keys, where both systems ran (a zero denominator gives inf)."""

    def ratio(num: str, den: str, key: str, den_key: str | None = None) -> float:
        d = rows[den][den_key or key]
        return rows[num][key] / d if d else float("inf")

    keys: dict[str, float] = {}
    have = set(rows)
    if {"pdd", "pd_intra_dc"} <= have:
        keys["gap_p99_pdd_over_intra"] = ratio("pdd", "pd_intra_dc", "gap_p99")
        keys["ttft_p99_pdd_over_intra"] = ratio("pdd", "pd_intra_dc", "ttft_p99")
    if {"pdd", "pd_cross_dc_naive"} <= have:
        keys["gap_p99_naive_over_pdd"] = ratio("pd_cross_dc_naive", "pdd", "wait_p99")
    if {"pdd", "pd_cross_dc"} <= have:
        keys["worst_wait_p99_crossdc_over_pdd"] = ratio("pd_cross_dc", "pdd", "wait_p99")
        keys["wan_bytes_crossdc_over_pdd"] = ratio("pd_cross_dc", "pdd", "wan_mb")
    return keys


#: The ablation, one mechanism at a time: what each step adds to the system before it.
ABLATION = (
    ("pd_cross_dc_naive", "pd_cross_dc", "the decoder's own prefix cache (pull only what it lacks)"),
    ("pd_cross_dc", "pdd_no_relay", "the first token from P, and routing by predicted gap onto a decoder that holds the context"),
    ("pdd_no_relay", "pdd", "the relay and handoff (RLD masks what the gap would be)"),
)


def print_results(rows: dict[str, dict[str, float]], pipelines: dict[str, dict[str, int]], keys: dict[str, float], title: str) -> None:
    table = Table(title=title)
    for col in (
        "system",
        "given",
        "hit P",
        "hit MD",
        "TTFT p50",
        "p90",
        "p99",
        "TPOT p50",
        "worst gap p50",
        "p99",
        "worst wait p99",
        "WAN MB",
        "failed",
        "pipelines",
    ):
        table.add_column(col, justify="right")
    for name, s in rows.items():
        table.add_row(
            name,
            SYSTEMS[name].given,
            f"{s['hit_p']:.0%}",
            f"{s['hit_md']:.0%}",
            *(f"{s[k]:.0f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99")),
            f"{s['tpot_p50']:.1f}",
            f"{s['gap_p50']:.0f}",
            f"{s['gap_p99']:.0f}",
            f"{s['wait_p99']:.0f}",
            f"{s['wan_mb']:.1f}",
            str(s["failed"]),
            " ".join(f"{k}:{v}" for k, v in sorted(pipelines[name].items())),
        )
    console.print(table)
    console.print("times in ms; worst wait = max(TTFT, worst inter-token gap) per request")
    console.print(
        "serving overhead p50 (TTFT at the conductor outside the engines' cores): "
        + ", ".join(f"{n} {s['serving_overhead_p50']:.1f} ms" for n, s in rows.items())
    )
    goals = {
        "gap_p99_pdd_over_intra": "goal <= 1.5",
        "ttft_p99_pdd_over_intra": "goal <= 1.1",
        "gap_p99_naive_over_pdd": "naive / pdd worst wait, goal >= 5",
        "worst_wait_p99_crossdc_over_pdd": "goal >= 3",
        "wan_bytes_crossdc_over_pdd": "expected near 1",
    }
    for key, value in keys.items():
        console.print(f"{key}: {value:.2f} ({goals[key]})")
    for before, after, what in ABLATION:
        if before in rows and after in rows:
            b, c = rows[before], rows[after]
            console.print(
                f"{before} -> {after}, adding {what}: worst-wait p99 {b['wait_p99']:.0f} -> {c['wait_p99']:.0f} ms "
                f"({b['wait_p99'] / c['wait_p99']:.2f}x less), TTFT p99 {b['ttft_p99']:.0f} -> {c['ttft_p99']:.0f} ms, "
                f"WAN {b['wan_mb']:.1f} -> {c['wan_mb']:.1f} MB"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=("open", "closed"), default="open")
    ap.add_argument("--api", choices=("completions", "chat", "tools"), default="completions", help="how turns are sent (see above)")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rps", type=float, default=1.0, help="open profile: the rate sessions' turns arrive at")
    ap.add_argument("--agents", type=int, default=4, help="closed profile: agents running conversations at once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--calibration-requests",
        type=int,
        default=None,
        help="requests of the calibration replay before each system's run (default: as many as --requests; 0: none)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    ap.add_argument("--gpu", action="store_true", help="CUDA vllm, 8B-shaped dummy model")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    if a.calibration_requests is None:
        a.calibration_requests = a.requests
    names = a.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})")

    base = bench_args(a.gpu)
    config = parse_config(base)
    trace = profile_trace(a.profile, a.requests, a.rps, a.seed, a.agents)
    hits = [r.prefix_tokens / r.prompt_tokens for r in trace]
    console.print(
        f"{a.profile} trace: {len(trace)} requests in {len({r.session for r in trace})} sessions over {trace[-1].arrival_s:.0f} s, "
        f"mean hit {sum(hits) / len(hits):.0%}, {sum(h > 0.95 for h in hits) / len(hits):.0%} above 95%, "
        f"{sum(h < 0.5 for h in hits) / len(hits):.0%} below 50% (first turns included), "
        f"outputs p50 {percentile([r.output_tokens for r in trace], 50):.0f} tokens"
    )
    calibration = []
    if a.calibration_requests:  # at the run's own rate of requests
        span = trace[-1].arrival_s * a.calibration_requests / len(trace)
        calibration = calibration_trace(a.calibration_requests, a.rps, a.seed + 1000, span, a.profile, a.agents)

    served: dict[str, Served] = {}
    groups: dict[tuple, list[str]] = {}
    for name in names:  # one app per set of replica counts, the systems it serves in the order asked
        groups.setdefault(SYSTEMS[name].replicas, []).append(name)
    with progress.steps(console, "requests", len(names) * (len(trace) + len(calibration))) as step:
        for group in groups.values():
            with LocalApp(system_args(base, SYSTEMS[group[0]]), name="pipelines") as app:
                wait_http(f"{app.base_url}/health")
                for name in group:
                    served[name] = serve_system(app, name, trace, calibration, a, config, step)

    rows = {name: summarize(name, served[name]) for name in names}
    pipelines = {name: served[name].pipelines for name in names}
    keys = ratios(rows)
    print_results(
        rows,
        pipelines,
        keys,
        f"{len(names)} systems on real engines, {a.profile} profile, {a.api} API: {len(trace)} agentic requests, same trace each, cold caches",
    )
    summary: dict = {
        "profile": a.profile,
        "api": a.api,
        "systems": rows,
        "given": {n: SYSTEMS[n].given for n in names},
        "pipelines": pipelines,
        "requests": len(trace),
        "rps": a.rps,
        **keys,
    }

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name in names:
            ok = served[name].result.ok
            for ax, values in ((axes[0], [x.ttft_s * 1000 for x in ok]), (axes[1], [max(x.ttft_s, x.max_gap_s) * 1000 for x in ok])):
                xs = sorted(values)
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        axes[0].set_title(f"TTFT CDF ({a.profile} profile)")
        axes[1].set_title("worst wait (max of TTFT, inter-token gap) CDF")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("ms")
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    all_rows = [row for name in names for row in request_rows(name, served[name])]
    csv_path = write_outputs(f"pipelines_{a.profile}" + ("" if a.api == "completions" else f"_{a.api}"), all_rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path}, {csv_path.with_suffix('.png')} and {', '.join(str(trace_path(n)) for n in names)}")


if __name__ == "__main__":
    main()
