"""Our app (colocated mode) vs vLLM's own OpenAI server, same model, same machine.

Both servers stay up and the rounds alternate (ours, vLLM, ours, vLLM, ...) so
machine noise hits both alike; the table shows medians over rounds. vLLM's
server gets our main decoder's engine arguments and engine environment
(app/engine/env.py `engine_env`: the model runner, and on CPU the threads, binding
and single-process settings); the bench prints what each side was given.

    python bench/serve_overhead.py [--rounds 3] [--logprobs N] [--json out.json] [--gpu]

`--gpu`: a CUDA machine, dummy weights of an 8B Llama shape, each server's
engine with 0.4 of the GPU's memory.

`--logprobs N` asks both servers for every token's log probability and its N
most likely alternatives: what rendering them costs each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from app.config import PDDConfig, RoleName
from bench.common import LoadResult, LocalApp, free_port, median, run_load, wait_http, write_outputs
from tests.conftest import local_args, on_one_gpu

console = Console(width=140)
MODEL = "pdd-dev"


def prompts(n: int, words: int) -> list[str]:
    return [" ".join(f"request {i} asks about block {j}" for j in range(words // 5)) for i in range(n)]


def colocated_args(max_model_len: int, gpu: bool = False) -> dict:
    """Our app in colocated mode: the main decoder's engine alone (on the GPU beside vLLM's)."""
    args = local_args()
    args["mode"] = "colocated"
    args["model"]["max_model_len"] = max_model_len
    if gpu:
        for role in ("prefill", "relay_decode"):
            args["roles"][role]["replicas"] = 0
        on_one_gpu(args, memory_fraction=0.4)
    return args


def vllm_server(args: dict, port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's own OpenAI server: its command line with the engine arguments our main_decode
    role uses, and the variables of our engine environment it starts with."""
    from app.engine.engine_args import engine_args
    from app.engine.env import engine_env

    config = PDDConfig.model_validate(args)
    e = engine_args(config, RoleName.main_decode)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        e.model,
        "--served-model-name",
        config.model.served_name,
        "--dtype",
        e.dtype,
        "--block-size",
        str(e.block_size),
        "--max-model-len",
        str(e.max_model_len),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--load-format",
        e.load_format,
        "--gpu-memory-utilization",
        str(e.gpu_memory_utilization),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {name: value for name, value in engine_env(config, RoleName.main_decode, os.environ).items() if value is not None}
    return cmd, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-c1", type=int, default=24)
    ap.add_argument("--requests-c16", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--logprobs", type=int, default=None, help="ask for log probabilities with this many alternatives (0-5)")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--gpu", action="store_true", help="CUDA vllm, 8B-shaped dummy model")
    a = ap.parse_args()

    if a.logprobs is not None and not 0 <= a.logprobs <= 5:
        raise SystemExit(f"--logprobs must be 0-5 (OpenAI's limit for completions), got {a.logprobs}")
    asked = {} if a.logprobs is None else {"logprobs": a.logprobs}
    args = colocated_args(4096, a.gpu)
    vllm_port = free_port()
    cmd, vllm_env = vllm_server(args, vllm_port)
    config = PDDConfig.model_validate(args)
    model, engine = config.model, config.roles.main_decode.engine
    console.print(
        f"each side: one engine, {model.source} ({model.dtype}), enforce_eager, prefix caching, "
        f"max_num_seqs {engine.max_num_seqs}; engine environment {' '.join(f'{k}={v}' for k, v in sorted(vllm_env.items()))}"
    )
    console.print(f"pdd-serve: Ray Serve ingress -> conductor -> token channel -> engine replica; vLLM: its OpenAI server, {' '.join(cmd[3:])}")
    results: dict[tuple[str, int], list[LoadResult]] = {}
    with LocalApp(args, name="overhead") as ours:
        vllm = subprocess.Popen(cmd, env={**os.environ, **vllm_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            console.print("waiting for both servers (engine start ~30 s each)")
            wait_http(f"{ours.base_url}/health")
            wait_http(f"http://127.0.0.1:{vllm_port}/v1/models", proc=vllm)
            servers = {"pdd-serve": f"{ours.base_url}/v1", "vllm": f"http://127.0.0.1:{vllm_port}/v1"}
            for url in servers.values():  # warm-up: first requests pay one-off costs
                asyncio.run(run_load(url, MODEL, prompts(4, a.prompt_words), concurrency=4, max_tokens=8))
            for rnd in range(a.rounds):
                for conc, n in ((1, a.requests_c1), (16, a.requests_c16)):
                    for name, url in servers.items():
                        r = asyncio.run(
                            run_load(url, MODEL, prompts(n, a.prompt_words), concurrency=conc, max_tokens=a.max_tokens, label=name, extra_body=asked)
                        )
                        failed = len(r.records) - len(r.ok)
                        console.print(
                            f"round {rnd + 1}/{a.rounds} {name:9s} c={conc:<2d} {r.output_tokens_per_s:7.0f} tok/s  TTFT p50 {r.ttft_ms(50):6.1f} ms"
                            + (f"  [red]{failed} failed[/red]" if failed else "")
                        )
                        results.setdefault((name, conc), []).append(r)
        finally:
            vllm.terminate()
            vllm.wait(timeout=60)

    rows = []
    for (name, conc), runs in results.items():
        rows.append(
            {
                "server": name,
                "concurrency": conc,
                "tok_per_s": median([r.output_tokens_per_s for r in runs]),
                "ttft_p50_ms": median([r.ttft_ms(50) for r in runs]),
                "ttft_p99_ms": median([r.ttft_ms(99) for r in runs]),
                "tpot_p50_ms": median([r.tpot_ms(50) for r in runs]),
                "failed": sum(len(r.records) - len(r.ok) for r in runs),
            }
        )
    by = {(r["server"], r["concurrency"]): r for r in rows}
    summary = {
        "throughput_ratio_c1": by[("pdd-serve", 1)]["tok_per_s"] / by[("vllm", 1)]["tok_per_s"],
        "throughput_ratio_c16": by[("pdd-serve", 16)]["tok_per_s"] / by[("vllm", 16)]["tok_per_s"],
        "ttft_p50_delta_ms_c1": by[("pdd-serve", 1)]["ttft_p50_ms"] - by[("vllm", 1)]["ttft_p50_ms"],
        "ttft_p50_delta_ms_c16": by[("pdd-serve", 16)]["ttft_p50_ms"] - by[("vllm", 16)]["ttft_p50_ms"],
        "rounds": a.rounds,
        "logprobs": a.logprobs,
        "rows": rows,
    }

    asking = "" if a.logprobs is None else f", logprobs with {a.logprobs} alternatives"
    table = Table(title=f"serve overhead: medians of {a.rounds} alternating rounds, {a.max_tokens} output tokens/request{asking}")
    for col in ("concurrency", "server", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "failed"):
        table.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["server"])):
        table.add_row(
            str(r["concurrency"]),
            r["server"],
            f"{r['tok_per_s']:.0f}",
            f"{r['ttft_p50_ms']:.1f}",
            f"{r['ttft_p99_ms']:.1f}",
            f"{r['tpot_p50_ms']:.2f}",
            str(r["failed"]),
        )
    console.print(table)
    console.print(
        f"throughput ratio (ours / vLLM): c1 {summary['throughput_ratio_c1']:.2f}x, c16 {summary['throughput_ratio_c16']:.2f}x (goal >= 0.9x at c16); "
        f"TTFT p50 delta: c1 {summary['ttft_p50_delta_ms_c1']:+.1f} ms (goal <= +5 ms), c16 {summary['ttft_p50_delta_ms_c16']:+.1f} ms"
    )

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, key, title in ((axes[0], "tok_per_s", "output tokens/s"), (axes[1], "ttft_p50_ms", "TTFT p50 (ms)")):
            for i, server in enumerate(("pdd-serve", "vllm")):
                vals = [by[(server, c)][key] for c in (1, 16)]
                ax.bar([x + i * 0.38 for x in range(2)], vals, width=0.38, label=server)
            ax.set_xticks([0.19, 1.19], ["c=1", "c=16"])
            ax.set_title(title)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    csv_path = write_outputs("serve_overhead" if a.logprobs is None else "serve_overhead_logprobs", rows, summary, a.json_path, plot)
    console.print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
