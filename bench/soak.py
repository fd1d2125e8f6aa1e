"""Soak: concurrent streaming clients for a fixed time, a fault injected every interval.

Faults rotate: kill a main decoder, kill the relay decoder, cut the WAN, stall
the WAN, expire prefill's KV leases, kill the prefill replica. A request ends in
one of three ways:
- completed: a finish reason and every token it asked for;
- failed: a clear error (an error event in the stream, an HTTP error, a dropped
  connection the client sees);
- lost: neither, which must never happen: no answer within the request timeout,
  or a stream that ends without finish reason or error, or fewer tokens than the
  finish reason claims.
Memory: RSS of every serving process alive at the start, sampled every
`--rss-every` seconds; each one's growth over the last third of the run tells
one that levels off from one that keeps growing. `--interval 0` injects no
fault (a memory soak: no replica restarts and starts its RSS over).

    python bench/soak.py [--duration 300] [--interval 45] [--clients 6] [--rss-every 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from rich.console import Console
from rich.table import Table

from app.ops.faults import Faults
from bench.common import LocalApp, percentile, wait_http, write_outputs
from tests.conftest import local_args

console = Console(width=140)
WAN = "dc-a->dc-b"


def faults_cycle(f: Faults):
    return itertools.cycle(
        [
            ("kill a main decoder", lambda: f.kill_replica("MainDecode")),
            ("cut the WAN for 8 s", lambda: f.cut_link(WAN, 8)),
            ("kill the relay decoder", lambda: f.kill_replica("RelayDecode")),
            ("stall the WAN for 3 s", lambda: f.stall_link(WAN, 3)),
            ("expire prefill's leases", f.expire_leases),
            ("kill the prefill replica", lambda: f.kill_replica("Prefill")),
        ]
    )


def serving_processes() -> dict[int, str]:
    """pid -> what it is: a replica, or an engine core named with the replica that started it."""
    replicas, engines = {}, []
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        name = p.info["name"] or ""
        cmd = " ".join(p.info["cmdline"] or [])
        if name.startswith("VLLM::"):
            engines.append(p.info)
        elif "ServeReplica:soak" in cmd:
            replicas[p.info["pid"]] = cmd.split()[0].removeprefix("ray::")
    for e in engines:
        parent = replicas.get(e["ppid"], f"pid {e['ppid']}")
        replicas[e["pid"]] = f"{e['name']} of {parent}"
    return replicas


def rss_mib(samples: list[tuple[float, dict[int, int]]], pid: int) -> tuple[list[float], list[float]]:
    """One process's samples: seconds into the soak, RSS in MiB."""
    points = [(t, got[pid] / 2**20) for t, got in samples if pid in got]
    return [t for t, _ in points], [m for _, m in points]


def last_third_mib_per_min(samples: list[tuple[float, dict[int, int]]], pid: int) -> float:
    """Least-squares RSS slope over the last third of the samples: near 0 once a process has levelled off."""
    ts, mibs = rss_mib(samples, pid)
    tail = len(ts) * 2 // 3
    if len(ts) - tail < 2:
        return float("nan")
    return statistics.linear_regression(ts[tail:], mibs[tail:]).slope * 60


def rss(pids) -> dict[int, int]:
    got = {}
    for pid in pids:
        try:
            got[pid] = psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return got


async def client_loop(url: str, origin: float, stop_at: float, rng: random.Random, timeout_s: float, outcomes: list[dict]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as http:
        conversation: list[int] = []
        while time.monotonic() < stop_at:
            if not conversation or rng.random() < 0.15:  # a new conversation, low hit
                conversation = [rng.randrange(10, 500) for _ in range(rng.randrange(600, 2400))]
            prompt = conversation + [rng.randrange(10, 500) for _ in range(rng.randrange(10, 80))]
            want = rng.randrange(16, 160)
            body = {"model": "pdd-dev", "prompt": prompt, "max_tokens": want, "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
            t0 = time.monotonic()
            record = {"outcome": "lost", "tokens": 0, "max_gap_s": 0.0, "detail": ""}
            output: list[int] = []
            last = None
            try:
                async with asyncio.timeout(timeout_s):
                    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            record.update(outcome="failed", detail=f"HTTP {resp.status_code}")
                        else:
                            finish = None
                            async for line in resp.aiter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                event = json.loads(line[6:])
                                if "error" in event:
                                    record.update(outcome="failed", detail=event["error"]["message"][:80])
                                    break
                                choice = event["choices"][0] if event.get("choices") else None
                                if choice:
                                    now = time.monotonic()
                                    if choice.get("token_ids"):
                                        if last is not None:
                                            record["max_gap_s"] = max(record["max_gap_s"], now - last)
                                        last = now
                                        output += choice["token_ids"]
                                    finish = choice.get("finish_reason") or finish
                            if record["outcome"] != "failed":
                                if finish == "length" and len(output) == want:
                                    record["outcome"] = "completed"
                                else:
                                    record["detail"] = f"finish={finish} tokens={len(output)}/{want}"
            except TimeoutError:
                record["detail"] = f"no answer in {timeout_s:.0f} s"
            except httpx.HTTPError as exc:
                record.update(outcome="failed", detail=type(exc).__name__)
            record["tokens"] = len(output)
            record["latency_s"] = time.monotonic() - t0
            record["start_s"], record["end_s"] = t0 - origin, time.monotonic() - origin
            outcomes.append(record)
            if record["outcome"] == "completed":
                conversation = prompt + output


def fault_impact(outcomes: list[dict], injected: list[tuple[float, str]]) -> list[dict]:
    """What each fault cost the requests in flight when it struck, beside the requests no fault touched."""

    def impact(label: str, group: list[dict]) -> dict:
        gaps = [o["max_gap_s"] * 1000 for o in group if o["outcome"] == "completed"]
        return {
            "requests": label,
            "n": len(group),
            "completed": len(gaps),
            "failed": sum(o["outcome"] == "failed" for o in group),
            "lost": sum(o["outcome"] == "lost" for o in group),
            "worst gap median ms": percentile(gaps, 50) if gaps else float("nan"),
            "worst gap max ms": max(gaps, default=float("nan")),
        }

    rows, touched = [], set()
    for at, name in injected:
        hit = [i for i, o in enumerate(outcomes) if o["start_s"] <= at <= o["end_s"]]
        touched.update(hit)
        rows.append(impact(f"{name} (at {at:.0f} s)", [outcomes[i] for i in hit]))
    return [impact("no fault in flight", [o for i, o in enumerate(outcomes) if i not in touched]), *rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--interval", type=float, default=45)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--rss-every", type=float, default=15, help="seconds between RSS samples")
    ap.add_argument("--request-timeout", type=float, default=180)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    args = local_args()
    args["roles"]["main_decode"]["replicas"] = 2
    args["server"] = {"request_timeout_s": a.request_timeout - 10}
    args["kv"] = {"lease_timeout_s": 30, "transfer_timeout_s": 30}
    outcomes: list[dict] = []
    injected: list[tuple[float, str]] = []
    samples: list[tuple[float, dict[int, int]]] = []
    with LocalApp(args, name="soak") as app:
        wait_http(f"{app.base_url}/health")
        f = Faults("soak", seed=0)
        processes = serving_processes()
        before = rss(processes)

        async def sample_rss(start: float, stop_at: float) -> None:
            while time.monotonic() < stop_at:
                samples.append((time.monotonic() - start, await asyncio.to_thread(rss, processes)))
                await asyncio.sleep(min(a.rss_every, max(0.0, stop_at - time.monotonic())))

        async def inject_faults(start: float, stop_at: float) -> None:
            for name, fault in faults_cycle(f):
                await asyncio.sleep(min(a.interval, max(0.0, stop_at - time.monotonic())))
                if time.monotonic() >= stop_at - 5:
                    break
                try:
                    await asyncio.to_thread(fault)
                    injected.append((time.monotonic() - start, name))
                    console.print(f"{time.monotonic() - start:6.0f} s  fault: {name}   (requests so far: {len(outcomes)})")
                except Exception as exc:  # noqa: BLE001 - e.g. the replica is still restarting
                    console.print(f"{time.monotonic() - start:6.0f} s  fault skipped ({name}): {exc}")

        async def run() -> None:
            start = time.monotonic()
            stop_at = start + a.duration
            rng = random.Random(0)
            clients = [
                asyncio.create_task(client_loop(app.base_url, start, stop_at, random.Random(rng.random()), a.request_timeout, outcomes))
                for _ in range(a.clients)
            ]
            sampler = asyncio.create_task(sample_rss(start, stop_at))
            if a.interval > 0:
                await inject_faults(start, stop_at)
            await asyncio.gather(*clients)
            sampler.cancel()

        asyncio.run(run())
        after = rss(serving_processes())

    survivors = set(before) & set(after)
    growth = {pid: (after[pid] - before[pid]) / before[pid] * 100 for pid in survivors}
    slope = {pid: last_third_mib_per_min(samples, pid) for pid in survivors}
    done = [o for o in outcomes if o["outcome"] == "completed"]
    failed = [o for o in outcomes if o["outcome"] == "failed"]
    lost = [o for o in outcomes if o["outcome"] == "lost"]
    summary = {
        "completed": len(done),
        "failed": len(failed),
        "lost": len(lost),
        "faults": len(injected),
        "gap_p99_ms": percentile([o["max_gap_s"] for o in done], 99) * 1000,
        "mem_growth_pct_max": max(growth.values(), default=0.0),
        "mem_last_third_mib_per_min_max": max((v for v in slope.values() if v == v), default=float("nan")),
        "processes_measured": len(survivors),
    }
    faults = f"a fault every {a.interval:.0f} s" if a.interval > 0 else "no faults"
    table = Table(title=f"soak: {a.clients} streaming clients for {a.duration:.0f} s, {faults}")
    for col in ("completed", "failed (clear error)", "lost", "faults", "worst gap p99 ms", "max RSS growth %", "processes"):
        table.add_column(col, justify="right")
    table.add_row(*(str(round(summary[k], 1)) for k in ("completed", "failed", "lost", "faults", "gap_p99_ms", "mem_growth_pct_max", "processes_measured")))
    console.print(table)
    impacts = fault_impact(outcomes, injected)
    summary["by_fault"] = impacts
    per_fault = Table(title="requests in flight when each fault struck")
    for col in impacts[0]:
        per_fault.add_column(col, justify="left" if col == "requests" else "right")
    for row in impacts:
        per_fault.add_row(*(v if isinstance(v, str) else f"{v:.0f}" for v in row.values()))
    console.print(per_fault)
    summary["rss"] = [
        {
            "process": processes[pid],
            "start_mib": before[pid] / 2**20,
            "end_mib": after[pid] / 2**20,
            "growth_pct": growth[pid],
            "last_third_mib_per_min": slope[pid],
        }
        for pid in sorted(survivors, key=lambda p: -growth[p])
    ]
    memory = Table(title=f"RSS of the processes alive throughout (sampled every {a.rss_every:g} s)")
    for col in ("process", "start MiB", "end MiB", "growth %", "last third MiB/min"):
        memory.add_column(col, justify="left" if col == "process" else "right")
    for row in summary["rss"]:
        memory.add_row(row["process"], f"{row['start_mib']:.0f}", f"{row['end_mib']:.0f}", f"{row['growth_pct']:+.1f}", f"{row['last_third_mib_per_min']:+.2f}")
    console.print(memory)
    for o in lost[:10]:
        console.print(f"[red]lost[/red]: {o['detail']}")
    reasons: dict[str, int] = {}
    for o in failed:
        reasons[o["detail"]] = reasons.get(o["detail"], 0) + 1
    for detail, n in sorted(reasons.items(), key=lambda x: -x[1])[:8]:
        console.print(f"failed x{n}: {detail}")

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (cdf, timeline, mem) = plt.subplots(1, 3, figsize=(19, 4))
        xs = sorted(o["max_gap_s"] * 1000 for o in done)
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        cdf.set_xscale("log")
        cdf.set_xlabel("worst inter-token gap per completed request (ms)")
        cdf.set_ylabel("fraction of completed requests")
        cdf.set_title(f"{len(done)} completed, {len(failed)} failed, {len(lost)} lost; {len(injected)} faults")
        timeline.scatter([o["start_s"] for o in done], [o["max_gap_s"] * 1000 for o in done], s=6, label="completed")
        if failed:
            timeline.scatter([o["start_s"] for o in failed], [max(o["max_gap_s"] * 1000, 1) for o in failed], s=12, marker="x", color="red", label="failed")
        for at, name in injected:
            timeline.axvline(at, color="grey", linestyle=":")
            timeline.annotate(name, (at, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
        timeline.set_yscale("log")
        timeline.set_xlabel("request start (s into the soak)")
        timeline.set_ylabel("worst inter-token gap (ms)")
        timeline.legend(loc="lower right", fontsize=7)
        for pid in survivors:
            mem.plot(*rss_mib(samples, pid), label=processes[pid])
        for at, _ in injected:
            mem.axvline(at, color="grey", linestyle=":")
        mem.set_xlabel("s into the soak")
        mem.set_ylabel("RSS (MiB)")
        mem.set_title("memory of the processes alive throughout")
        mem.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("soak", outcomes, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
