"""Calibration: measure a real vLLM engine of the config on this machine, alone or serving.

Machines without an accelerator spec (the CPU dev cluster) have no roofline;
`measure` runs one real engine of the config (the role's engine arguments,
app/engine/replica.py) in this process and `calibrate` fits `FittedPerf`
(app/sim/perf.py) to its steps:

- prefill steps: one fresh prompt of N tokens with `max_tokens=1`, N up to the
  engine's token budget so it is one step; its wall time is that step (N
  tokens read, N(N+1)/2 attention pairs);
- prefill steps after a cached prefix, as most agentic turns are: a prompt of K
  tokens is sent once to cache it, then the same K plus N new tokens; that
  second request's wall time is one step of N tokens reading K + N
  (N*K + N(N+1)/2 pairs). A chunk attending to a long prefix runs another
  kernel path than a fresh prompt, at its own cost per pair;
- decode steps: n fresh prompts of K tokens decoding together; from the last
  one's first token to the first one's end, every step decodes all n, reading
  about n x K context tokens (as many attention pairs): that window over its
  steps is one step.

Every prompt starts with a token no other prompt of the run starts with, so the
prefix cache hits only where a sample sends a prefix again on purpose.
`take_app_steps` collects the steps a running app's engines timed
(`engine.record_steps`), and `app_journeys` its journeys; app/sim/fitting.py
fits the model to them. `model_spec_from_folder` reads a Hugging Face model
folder's config.json for the figures the twin needs when the serve config has
no `model.spec`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from app.config import ModelSpec, PDDConfig, RoleName
from app.sim.perf import FittedPerf, StepSample, chunk_attention_pairs, fit_from_samples

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Prompt lengths of the prefill samples (clipped to the engine's token budget).
PREFILL_TOKENS = (64, 256, 512, 1024, 2048, 4096)
#: (cached prefix tokens, new tokens) of the prefill samples after a cached prefix
#: (the prefix rounded down to whole KV blocks, the sum clipped to the model length).
PREFIX_SHAPES = ((2048, 64), (4096, 64), (6144, 256), (4096, 1024), (2048, 2048))
#: (sequences, prompt tokens each) of the decode samples.
DECODE_SHAPES = ((1, 256), (1, 4096), (4, 256), (4, 2048), (8, 1024), (16, 512), (16, 2048))
DECODE_TOKENS = 48
#: Runs of each shape; its sample is the fastest.
REPEATS = 3


def model_spec_from_folder(folder: str | Path, dtype: str = "auto") -> ModelSpec:
    """The twin's model figures from a dense transformer's config.json and weight files."""
    folder = Path(folder)
    try:
        hf = json.loads((folder / "config.json").read_text())
    except OSError as err:
        raise ValueError(f"model.spec is not set and {folder} has no readable config.json: {err}") from None
    layers = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = hf.get("num_key_value_heads", heads)
    name = (hf.get("dtype") or hf.get("torch_dtype") or "float32") if dtype == "auto" else dtype
    width = DTYPE_BYTES.get(str(name), 2)
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    params = weights / width if weights else 12 * layers * hf["hidden_size"] ** 2
    return ModelSpec(
        active_params_b=params / 1e9,
        weight_bytes_per_param=width,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * width,
        attention_flops_per_token_pair=4.0 * layers * heads * head_dim,
    )


def with_model_spec(config: PDDConfig) -> PDDConfig:
    """`config` with `model.spec` filled from the model folder when it has none."""
    if config.model.spec is not None:
        return config
    from app.engine.devmodel import resolve_model_source

    spec = model_spec_from_folder(resolve_model_source(config.model.source), config.model.dtype)
    return config.model_copy(update={"model": config.model.model_copy(update={"spec": spec})})


class _Prompts:
    """Token ids whose first token differs from every earlier prompt's: no prefix hits."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.n = 0

    def __call__(self, length: int) -> list[int]:
        self.n += 1
        lead = [3 + (self.n // (self.vocab - 3)) % (self.vocab - 3), 3 + self.n % (self.vocab - 3)]
        return (lead + [3 + (i * 7919 + self.n) % (self.vocab - 3) for i in range(length)])[:length]


async def _generate(engine, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of each output token."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
        now = time.perf_counter()
        times.extend(now for _ in range(len(out.outputs[0].token_ids) - len(times)))
    return times


async def measure(
    config: PDDConfig,
    role: RoleName = RoleName.prefill,
    *,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    prefix_shapes: Sequence[tuple[int, int]] = PREFIX_SHAPES,
    decode_shapes: Sequence[tuple[int, int]] = DECODE_SHAPES,
    decode_tokens: int = DECODE_TOKENS,
    repeats: int = REPEATS,
    progress: Callable[[str], None] = lambda _msg: None,
) -> list[StepSample]:
    """Step samples of one real engine with `role`'s engine arguments, one per
    shape: the fastest of `repeats` runs, since other work on the host only ever
    adds time to a run, and one slow run would otherwise pull the fit."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.engine.engine_args import engine_args
    from app.engine.env import set_engine_env

    progress("starting the engine")
    set_engine_env(config, role)
    engine = AsyncLLM.from_engine_args(engine_args(config, role))
    try:
        vllm_config = engine.vllm_config
        budget = vllm_config.scheduler_config.max_num_batched_tokens
        limit = min(budget, config.model.max_model_len - 1)
        prompts = _Prompts(vllm_config.model_config.get_vocab_size())
        await _generate(engine, prompts(32), 2)  # first-call costs out of the samples
        samples: list[StepSample] = []
        for n in sorted({min(n, limit) for n in prefill_tokens}):
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                await _generate(engine, prompts(n), 1)
                runs.append((time.perf_counter() - start) * 1000)
            samples.append(StepSample(n, 0, n, min(runs), chunk_attention_pairs(n, 0)))
            progress(f"prefill {n} tokens: {samples[-1].step_ms:.1f} ms")
        block = vllm_config.cache_config.block_size
        for cached, new in prefix_shapes:
            new = min(new, limit)
            cached = min(cached, config.model.max_model_len - new - 1) // block * block
            if cached <= 0:
                continue
            runs = []
            for _ in range(repeats):
                prefix = prompts(cached)
                await _generate(engine, prefix, 1)
                start = time.perf_counter()
                await _generate(engine, prefix + prompts(new), 1)
                runs.append((time.perf_counter() - start) * 1000)
            samples.append(StepSample(new, 0, cached + new, min(runs), chunk_attention_pairs(new, cached), prefix_chunks=1))
            progress(f"prefill {new} tokens after {cached} cached: {samples[-1].step_ms:.1f} ms")
        for seqs, context in decode_shapes:
            context = min(context, config.model.max_model_len - decode_tokens - 1)
            if seqs > vllm_config.scheduler_config.max_num_seqs:
                continue
            step_ms = []
            for _ in range(repeats):
                arrivals = await asyncio.gather(*(_generate(engine, prompts(context), decode_tokens) for _ in range(seqs)))
                last = max(arrivals, key=lambda t: t[0])
                end = min(t[-1] for t in arrivals)
                if steps := sum(1 for t in last if last[0] < t <= end):
                    step_ms.append((end - last[0]) * 1000 / steps)
            if not step_ms:
                continue
            read = seqs * (context + decode_tokens // 2)
            samples.append(StepSample(0, seqs, read, min(step_ms), read))
            progress(f"decode {seqs} x {context} tokens: {samples[-1].step_ms:.1f} ms per step")
        return samples
    finally:
        engine.shutdown()
        del engine  # its __del__ shuts down again: now, not at interpreter exit when vLLM's modules are gone


def calibrate(config: PDDConfig, role: RoleName = RoleName.prefill, **kw) -> tuple[FittedPerf, list[StepSample]]:
    samples = asyncio.run(measure(config, role, **kw))
    return fit_from_samples(samples), samples


def take_app_steps(app_name: str, clear: bool = True) -> dict[RoleName, list[StepSample]]:
    """The steps every engine of a running app timed since the last clearing take,
    by role (empty where `roles.ROLE.engine.record_steps` is off); `clear=False`
    leaves them for the next take. Call from a Ray driver attached to the app's cluster."""
    from ray import serve

    from app.engine.deployments import DEPLOYMENT_NAMES
    from app.ops.faults import Faults

    faults = Faults(app_name)
    steps: dict[RoleName, list[StepSample]] = {}
    for role, deployment in DEPLOYMENT_NAMES.items():
        replicas = faults.replicas(deployment)
        if not replicas:
            continue
        handle = serve.get_deployment_handle(deployment, app_name=app_name)
        taken = [handle.take_steps.remote(clear, target_replica=name.rsplit("#", 1)[-1]) for name in replicas]
        steps[role] = [StepSample(**s, engine=name) for name, call in zip(replicas, taken) for s in call.result()]
    return steps


def app_journeys(url: str) -> list[dict]:
    """Every journey the app at `url` still keeps (GET /pdd/requests;
    PDD_API_KEY for auth), for `serving_overheads` and `kv_pulls`. Raises
    ConnectionError naming the address when they cannot be read."""
    import httpx

    from app.conductor.journal import JOURNAL_CAPACITY
    from app.ops.status import api_headers

    try:
        resp = httpx.get(f"{url}/pdd/requests", params={"limit": JOURNAL_CAPACITY}, timeout=30, headers=api_headers())
        resp.raise_for_status()
    except httpx.HTTPError as err:
        raise ConnectionError(f"cannot read {url}/pdd/requests: {err}") from None
    return resp.json()["requests"]
