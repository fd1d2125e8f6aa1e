"""Handing 100 eager tokens to MD: extend-decode recompute vs shipping their KV over the WAN.

Each run prepares the handoff on real engines as a P-RLD-MD request does (P
prefills, RLD pulls the prompt KV and decodes the eager tokens, MD pulls the
prompt KV over the WAN), then times the handoff itself, from MD receiving the
request to MD's first token:
- recompute: MD gets prompt + the eager token IDs and recomputes their KV in one
  extend step (what pdd-serve does);
- KV path: RLD leases the eager tokens' KV blocks and MD pulls them over the
  emulated WAN (RTT, jitter), then decodes.
Two fresh prompts per run, one per path, so both start from the same MD cache state.

    python bench/handoff.py [--runs 30] [--eager 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.engine.cluster_tls import cluster_tls
from app.engine.kv.params import LEASE, PRODUCE, PULL
from app.engine.link_emulators import deployment_name
from app.engine.token_channel import EngineRequest, SamplingOptions, TokenStreamClient
from bench.common import LocalApp, wait_http, write_outputs
from tests.conftest import local_args

console = Console(width=140)
WAN = "dc-a->dc-b"
INTRA = "dc-a->dc-a"


class Engines:
    """Direct token-channel access to one replica per role (the benchmark drives the mechanism)."""

    def __init__(self, app_name: str):
        from ray import serve

        self.info = {d: serve.get_deployment_handle(d, app_name=app_name).describe.remote().result() for d in ("Prefill", "RelayDecode", "MainDecode")}
        self.relays = {}
        for dc in ("dc-a", "dc-b"):
            self.relays.update(serve.get_deployment_handle(deployment_name(dc), app_name=app_name).describe.remote().result())
        self.clients = {d: TokenStreamClient(i.node_ip, i.token_port, cluster_tls().client) for d, i in self.info.items()}

    async def run(self, deployment: str, rid: str, prompt: list[int], max_tokens: int, kv: dict | None = None) -> tuple[list[int], dict | None, float]:
        """(tokens, final kv_transfer_params, seconds to the first token)."""
        t0 = time.perf_counter()
        first = None
        tokens: list[int] = []
        params = None
        request = EngineRequest(rid, prompt, SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True), kv_transfer_params=kv)
        async for delta in self.clients[deployment].stream(request):
            if delta.error:
                raise RuntimeError(delta.error)
            if delta.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += delta.token_ids
            if delta.finished:
                params = delta.kv_transfer_params
        return tokens, params, first if first is not None else time.perf_counter() - t0

    def pull(self, lease: dict, link: str) -> dict:
        return {PULL: {**lease, "relay": self.relays[link], "link": link}}


async def prepare(engines: Engines, tag: str, prompt: list[int], eager: int) -> list[int]:
    """P prefills; RLD relays `eager` tokens; MD holds the prompt KV. Returns the eager tokens."""
    first, params, _ = await engines.run("Prefill", f"{tag}-p", prompt, 1, {PRODUCE: {"consumers": 2}})
    lease = params[LEASE]
    relay, _, _ = await engines.run("RelayDecode", f"{tag}-rld", prompt + first, eager - 1, engines.pull(lease, INTRA))
    await engines.run("MainDecode", f"{tag}-warm", prompt + first, 1, engines.pull(lease, WAN))
    return first + relay


async def one_run(engines: Engines, i: int, prompt_len: int, eager: int, rng: random.Random) -> tuple[float, float, int]:
    # recompute path
    prompt = [rng.randrange(10, 500) for _ in range(prompt_len)]
    tokens = await prepare(engines, f"r{i}", prompt, eager)
    _, _, recompute_s = await engines.run("MainDecode", f"r{i}-handoff", prompt + tokens, 1)
    # KV path: RLD leases prompt + eager KV (its prefix cache holds it), MD pulls what it lacks
    prompt = [rng.randrange(10, 500) for _ in range(prompt_len)]
    tokens = await prepare(engines, f"k{i}", prompt, eager)
    _, params, _ = await engines.run("RelayDecode", f"k{i}-lease", prompt + tokens, 1, {PRODUCE: {"consumers": 1}})
    _, _, kv_s = await engines.run("MainDecode", f"k{i}-handoff", prompt + tokens, 1, engines.pull(params[LEASE], WAN))
    return recompute_s, kv_s, len(tokens)


def stats(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"mean": statistics.mean(ms), "max": max(ms), "std": statistics.stdev(ms), "p50": statistics.median(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--eager", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()

    args = local_args()  # the local WAN: 40 Mbit/s, 30 ms RTT, lognormal jitter (mean 10 ms, std 20 ms)
    rng = random.Random(0)
    rows = []
    with LocalApp(args, name="handoff") as app:
        wait_http(f"{app.base_url}/health")
        engines = Engines("handoff")

        async def all_runs() -> None:
            for i in range(a.runs):
                recompute_s, kv_s, n = await one_run(engines, i, a.prompt_tokens, a.eager, rng)
                rows.append({"run": i, "eager_tokens": n, "recompute_ms": recompute_s * 1000, "kv_ms": kv_s * 1000})
                console.print(f"[{i + 1}/{a.runs}] recompute {recompute_s * 1000:6.1f} ms   KV over WAN {kv_s * 1000:6.1f} ms")

        asyncio.run(all_runs())

    rec = stats([r["recompute_ms"] / 1000 for r in rows])
    kv = stats([r["kv_ms"] / 1000 for r in rows])
    table = Table(title=f"handoff of {a.eager} eager tokens to MD, {a.runs} runs ({a.prompt_tokens}-token prompts)")
    for col in ("path", "mean ms", "p50 ms", "max ms", "std ms"):
        table.add_column(col, justify="right")
    table.add_row("extend-decode recompute", *(f"{rec[k]:.1f}" for k in ("mean", "p50", "max", "std")))
    table.add_row("KV over the WAN", *(f"{kv[k]:.1f}" for k in ("mean", "p50", "max", "std")))
    console.print(table)
    summary = {"recompute_std_ms": rec["std"], "kv_std_ms": kv["std"], "recompute": rec, "kv": kv, "std_ratio": rec["std"] / kv["std"]}
    console.print(f"recompute std / KV std = {summary['std_ratio']:.2f} (goal <= 0.2)")

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist([r["recompute_ms"] for r in rows], bins=20, alpha=0.7, label="recompute")
        ax.hist([r["kv_ms"] for r in rows], bins=20, alpha=0.7, label="KV over WAN")
        ax.set_xlabel("handoff time (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("handoff", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
