"""Shared benchmark machinery: a local app, an OpenAI-client load generator, reports."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Where benchmarks write their tables, plots and traces (PDD_BENCH_OUT: elsewhere, as
#: bench/gpu_check.py puts one run's outputs in one folder).
OUT_DIR = Path(os.environ.get("PDD_BENCH_OUT") or ROOT / "bench" / "out")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class RequestRecord:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    gaps_s: list[float] = field(default_factory=list)
    """Time between consecutive content chunks."""
    text: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        n = self.completion_tokens - 1
        return (self.latency_s - self.ttft_s) / n if n > 0 else float("nan")

    @property
    def max_gap_s(self) -> float:
        return max(self.gaps_s, default=0.0)


@dataclass
class LoadResult:
    label: str
    concurrency: int
    wall_s: float
    records: list[RequestRecord]

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.ok) / self.wall_s

    def ttft_ms(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.ok], q) * 1000

    def gap_ms(self, q: float) -> float:
        return percentile([r.max_gap_s for r in self.ok], q) * 1000

    def tpot_ms(self, q: float) -> float:
        return percentile([r.tpot_s for r in self.ok if r.completion_tokens > 1], q) * 1000


class Timed:
    """One streamed request as its client sees it: when it went out, its first token, the gaps after."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []

    def token(self) -> None:
        """A chunk with the engines' next tokens arrived."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def done(self, tokens: int) -> RequestRecord:
        end = time.perf_counter()
        return RequestRecord((self.first or end) - self.start, end - self.start, tokens, self.gaps)

    def failed(self, exc: Exception) -> RequestRecord:
        return RequestRecord(float("nan"), time.perf_counter() - self.start, 0, error=f"{type(exc).__name__}: {exc}")


class Replayed:
    """What an agentic replay's requests got, by their index in the trace (each turn fills its own)."""

    def __init__(self, trace: Sequence[Any]):
        self.trace = trace
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord | None] = [None] * len(trace)
        self.ids: list[str] = [""] * len(trace)
        self.sent: list[Any] = [None] * len(trace)

    async def begin(self, i: int, keep: int) -> Timed:
        """Request i goes out at its arrival time (or now, when later), `keep` tokens of its conversation repeated."""
        r = self.trace[i]
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - self.t0)))
        timed = Timed()
        self.sent[i] = r._replace(arrival_s=timed.start - self.t0, prefix_tokens=keep)
        return timed


async def replay_sessions(
    trace: Sequence[Any], mode: str, seed: int, step: Callable[[str], None], turn: Callable[[Replayed, int, Any, random.Random], Awaitable[Any]]
) -> tuple[LoadResult, list[str], list[Any]]:
    """Sessions side by side, each one's turns in order: `turn(replayed, i, conversation, rng)` sends
    request i after the conversation so far (None at a session's start) and returns it grown.
    Returns the results, the request ids and the trace as sent; `step(name)` as each request ends."""
    replayed = Replayed(trace)
    sessions: dict[Any, list[int]] = {}
    for i, r in enumerate(trace):
        sessions.setdefault(r.session, []).append(i)
    done = 0

    async def session(turns: list[int]) -> None:
        nonlocal done
        rng = random.Random(seed * 1_000_003 + turns[0])
        conversation = None
        for i in turns:
            conversation = await turn(replayed, i, conversation, rng)
            done += 1
            step(f"{mode} {done}/{len(trace)}")

    await asyncio.gather(*(session(turns) for turns in sessions.values()))
    records = [r for r in replayed.records if r is not None]
    return LoadResult(mode, 0, time.perf_counter() - replayed.t0, records), replayed.ids, [r for r in replayed.sent if r is not None]


async def _one(client, model: str, prompt: Any, max_tokens: int, extra_body: dict[str, Any]) -> RequestRecord:
    t0 = time.perf_counter()
    first = None
    last = None
    gaps = []
    parts = []
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **extra_body},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                parts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return RequestRecord(float("nan"), time.perf_counter() - t0, 0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return RequestRecord((first or end) - t0, end - t0, tokens, gaps, "".join(parts))


async def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[Any],
    *,
    concurrency: int,
    max_tokens: int,
    label: str = "",
    extra_body: dict[str, Any] | None = None,
) -> LoadResult:
    """Send every prompt once, `concurrency` at a time, streaming; record each request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("PDD_API_KEY", "none"), max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    records: list[RequestRecord | None] = [None] * len(prompts)

    async def worker(i: int) -> None:
        async with sem:
            records[i] = await _one(client, model, prompts[i], max_tokens, extra_body or {})

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    await client.close()
    return LoadResult(label, concurrency, wall, [r for r in records if r is not None])


def wait_http(url: str, timeout_s: float = 300, proc=None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


class LocalApp:
    """Our app on a throwaway local Ray cluster (as `pdd run` starts it), for benchmarks."""

    def __init__(self, args: dict[str, Any], name: str = "bench"):
        self.args = args
        self.name = name
        self.port = free_port()

    def __enter__(self) -> LocalApp:
        import ray
        from ray import serve

        from app.builder import build_app
        from app.ops.cluster import serve_env

        os.environ.update({k: v for k, v in serve_env().items() if k != "RAY_AUTH_MODE"})
        os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(free_port())
        os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] = str(free_port())
        ray.init(address="local", num_cpus=8, resources={"dc_a": 100, "dc_b": 100}, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(build_app(self.args), name=self.name, route_prefix="/")
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        from app.ops.cluster import kill_orphans

        serve.shutdown()
        ray.shutdown()
        kill_orphans()


def write_outputs(name: str, rows: list[dict[str, Any]], summary: dict[str, Any], json_path: str | None, plot: Callable[[Path], None] | None = None) -> Path:
    """CSV of rows + optional PNG under bench/out/, and the summary JSON where asked."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    csv_path = OUT_DIR / f"{name}.csv"
    if rows:
        with csv_path.open("w", newline="") as f:
            # rows of different kinds share one file: every key is a column, blank where absent
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
            writer.writeheader()
            writer.writerows(rows)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(OUT_DIR / f"{name}.png")
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2, default=float))
    return csv_path


def completion_journey(base_url: str, prompt: list[int], mode: str | None = None, **extra_body: Any) -> dict[str, Any]:
    """One 2-token greedy completion of `prompt` (served in `mode` when given) and
    its journey as the conductor recorded it (GET /pdd/requests/{id})."""
    import httpx

    body = {"model": "pdd-dev", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra_body}
    if mode:
        body["pdd_mode"] = mode
    out = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    out.raise_for_status()
    return httpx.get(f"{base_url}/pdd/requests/{out.json()['id']}", timeout=30).json()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def records_as_dicts(result: LoadResult) -> list[dict[str, Any]]:
    return [
        {"label": result.label, "concurrency": result.concurrency, **{k: v for k, v in asdict(r).items() if k not in ("gaps_s", "text")}}
        for r in result.records
    ]
