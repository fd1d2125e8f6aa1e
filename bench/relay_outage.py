"""While the relay decoder is replaced: P relays (P-P-MD) vs P-MD, same faults, same traffic.

For each setting of `routing.prefill_relays` (off first: the baseline), one local
app (the README's default shape, a 40 Mbit/s WAN) is started, then for each round
the relay decoder's replica is killed as a crash would, and streaming clients send
new low-hit conversations (1,200-2,400-token prompts, 64-160 tokens out) for
`--window` seconds; the next round waits for Serve's replacement. Every request
started in a window counts: its worst inter-token gap, its TTFT and the pipeline
the conductor chose (its journey). The table gives both settings and their ratio,
and how long Serve took to replace the relay decoder (on this host P's relaying
and the new engine's start share the CPUs; on GPUs they do not).

    python bench/relay_outage.py [--rounds 3] [--window 30] [--clients 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from rich.console import Console
from rich.table import Table

from app.ops.faults import Faults
from bench.common import LocalApp, median, percentile, wait_http, write_outputs
from tests.conftest import local_args

console = Console(width=140)
APP = "outage"


async def client(url: str, stop_at: float, rng: random.Random, out: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=180) as http:
        while time.monotonic() < stop_at:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(1200, 2400))]
            want = rng.randrange(64, 160)
            body = {"model": "pdd-dev", "prompt": prompt, "max_tokens": want, "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
            t0 = time.monotonic()
            record = {"id": "", "ttft_s": float("nan"), "max_gap_s": 0.0, "tokens": 0, "ok": False}
            last = None
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            break
                        record["id"] = event.get("id", record["id"])
                        for choice in event.get("choices") or []:
                            if choice.get("token_ids"):
                                now = time.monotonic()
                                if last is None:
                                    record["ttft_s"] = now - t0
                                else:
                                    record["max_gap_s"] = max(record["max_gap_s"], now - last)
                                last = now
                                record["tokens"] += len(choice["token_ids"])
                record["ok"] = record["tokens"] == want
            except httpx.HTTPError:
                pass
            out.append(record)


def app_healthy() -> bool:
    from ray import serve

    app = serve.status().applications.get(APP)
    return app is not None and app.status == "RUNNING" and all(d.status == "HEALTHY" for d in app.deployments.values())


def wait_relay_back(timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if app_healthy():
            return
        time.sleep(1)
    raise TimeoutError(f"the relay decoder was not replaced within {timeout_s:.0f} s")


async def replaced_after(killed_at: float, timeout_s: float = 180) -> float:
    """Seconds from the kill until Serve reports the app healthy again, once it has seen it not."""
    seen_down = False
    while time.monotonic() < killed_at + timeout_s:
        healthy = await asyncio.to_thread(app_healthy)
        if not healthy:
            seen_down = True
        elif seen_down:
            return time.monotonic() - killed_at
        await asyncio.sleep(0.5)
    return float("nan")


def run_setting(prefill_relays: bool, a: argparse.Namespace, journeys: dict[str, dict]) -> list[dict]:
    args = local_args()
    args["routing"] = {"prefill_relays": prefill_relays}
    records: list[dict] = []
    with LocalApp(args, name=APP) as app:
        wait_http(f"{app.base_url}/health")
        # a serving app: the conductor has found every role's replicas before the first kill
        warm = random.Random(-1)
        for _ in range(2):
            httpx.post(
                f"{app.base_url}/v1/completions",
                timeout=300,
                json={"model": "pdd-dev", "prompt": [warm.randrange(10, 500) for _ in range(2000)], "max_tokens": 16, "temperature": 0},
            ).raise_for_status()
        faults = Faults(APP, seed=0)
        for r in range(a.rounds):
            wait_relay_back()
            time.sleep(5)  # Serve's health shows the new replica before every router has it
            faults.kill_replica("RelayDecode")
            killed_at = time.monotonic()
            got: list[dict] = []

            async def window(killed_at: float = killed_at, r: int = r, got: list[dict] = got) -> float:
                stop_at = killed_at + a.window
                watch = asyncio.create_task(replaced_after(killed_at))
                await asyncio.gather(*(client(app.base_url, stop_at, random.Random(1000 * r + i), got) for i in range(a.clients)))
                return await watch

            back_s = asyncio.run(window())
            console.print(f"prefill_relays={prefill_relays}: round {r + 1}/{a.rounds}: relay decoder killed, replaced after {back_s:.0f} s")
            for rec in got:
                journey = httpx.get(f"{app.base_url}/pdd/requests/{rec['id']}", timeout=30).json() if rec["id"] else {}
                sources = journey.get("token_sources") or []
                rec.update(
                    setting="P relays" if prefill_relays else "P-MD",
                    round=r + 1,
                    relay_back_s=back_s,
                    pipeline=journey.get("pipeline", "?"),
                    prefill_tokens=sum(n for role, n in sources if role == "prefill"),
                )
                journeys[rec["id"]] = journey
            records += got
    return records


def summarize(records: list[dict]) -> dict:
    done = [r for r in records if r["ok"]]
    gaps = [r["max_gap_s"] * 1000 for r in done]
    ttft = [r["ttft_s"] * 1000 for r in done]
    return {
        "relay_back_s": median([back for _, back in {(r["round"], r["relay_back_s"]) for r in records}]),
        "requests": len(records),
        "completed": len(done),
        "pipelines": dict(Counter(r["pipeline"] for r in records).most_common()),
        "worst_gap_p50_ms": median(gaps),
        "worst_gap_p90_ms": percentile(gaps, 90) if gaps else float("nan"),
        "worst_gap_max_ms": max(gaps, default=float("nan")),
        "ttft_p50_ms": median(ttft),
        "ttft_p90_ms": percentile(ttft, 90) if ttft else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="relay decoder kills per setting")
    ap.add_argument("--window", type=float, default=30, help="seconds of new requests after each kill")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    journeys: dict[str, dict] = {}
    records = run_setting(False, a, journeys) + run_setting(True, a, journeys)
    base = summarize([r for r in records if r["setting"] == "P-MD"])
    relays = summarize([r for r in records if r["setting"] == "P relays"])
    table = Table(title=f"requests started within {a.window:.0f} s of a relay decoder kill ({a.rounds} kills each, {a.clients} streaming clients)")
    for col in ("routing.prefill_relays", "requests", "completed", "pipelines", "worst gap p50 / p90 / max ms", "TTFT p50 / p90 ms", "relay back after s"):
        table.add_column(col, justify="left" if col in ("routing.prefill_relays", "pipelines") else "right")
    for name, s in (("false (P-MD)", base), ("true (P-P-MD)", relays)):
        table.add_row(
            name,
            str(s["requests"]),
            str(s["completed"]),
            ", ".join(f"{p} {n}" for p, n in s["pipelines"].items()),
            f"{s['worst_gap_p50_ms']:.0f} / {s['worst_gap_p90_ms']:.0f} / {s['worst_gap_max_ms']:.0f}",
            f"{s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f}",
            f"{s['relay_back_s']:.0f}",
        )
    ratio = {
        k: relays[k] / base[k] for k in ("worst_gap_p50_ms", "worst_gap_p90_ms", "worst_gap_max_ms", "ttft_p50_ms", "ttft_p90_ms", "relay_back_s") if base[k]
    }
    table.add_row(
        "ratio true / false",
        "",
        "",
        "",
        " / ".join(f"{ratio.get(k, float('nan')):.2f}x" for k in ("worst_gap_p50_ms", "worst_gap_p90_ms", "worst_gap_max_ms")),
        " / ".join(f"{ratio.get(k, float('nan')):.2f}x" for k in ("ttft_p50_ms", "ttft_p90_ms")),
        f"{ratio.get('relay_back_s', float('nan')):.2f}x",
    )
    console.print(table)

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for setting, label in (("P-MD", "prefill_relays: false (P-MD)"), ("P relays", "prefill_relays: true (P-P-MD)")):
            xs = sorted(r["max_gap_s"] * 1000 for r in records if r["setting"] == setting and r["ok"])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        ax.set_xlabel("worst inter-token gap per request (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("requests started while the relay decoder is replaced")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    path = write_outputs("relay_outage", records, {"p_md": base, "prefill_relays": relays, "ratio": ratio}, a.json_path, plot)
    worst = sorted(records, key=lambda r: -r["max_gap_s"])[:10]
    path.with_name("relay_outage_worst_journeys.json").write_text(json.dumps([journeys.get(r["id"], {}) for r in worst], indent=1))
    console.print(f"rows: {path}; plot: {path.with_suffix('.png')}; the 10 worst gaps' journeys: {path.with_name('relay_outage_worst_journeys.json')}")


if __name__ == "__main__":
    main()
