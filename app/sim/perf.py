"""How long one engine step takes, from its batch shape.

A step of a continuous-batching engine runs `prefill_tokens` new prompt tokens
(chunks of one or more prompts) and one token for each of `decode_seqs`
running sequences. Two models answer the same questions:

- `Roofline`: from the accelerator's peak FLOP/s and memory bandwidth and the
  model's size figures (config: `node_groups.*.spec`, `model.spec`); a step
  takes the longer of its compute time and its memory time (weights, plus the
  KV attention reads: `kv_read_bytes_per_token` per context token).
- `FittedPerf`: `step = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read
  + e*attention_pairs + f*prefix_chunks`, fitted to measured steps
  (`fit_from_samples`); the calibration path for machines without a spec, such
  as the CPU dev cluster. The pair term is what makes a long prefill cost more
  per token than a short one; the chunk term, a short chunk after a long cached
  prefix cost more than its tokens.

Decode-only stretches are simulated without a per-step event: with `n`
sequences and `K0` context tokens, step `k` reads `K0 + k*n` tokens, so its
time is the larger of two lines in `k` (`decode_lines`) and `DecodeRamp` sums
and inverts those steps in closed form.

Samples JSON (`load_samples`): `{"samples": [{"prefill_tokens": int,
"decode_seqs": int, "kv_tokens_read": int, "step_ms": float,
"attention_pairs": float}, ...]}`, one entry per measured engine step;
`kv_tokens_read` counts the context tokens attention read in that step (every
running sequence's context plus each prefill chunk's cached prefix and the
chunk itself), `attention_pairs` the (query, key) token pairs it computed
(optional, 0 when unknown: the fit then has no pair term). A fitted model saves
as `{"a_ms": ..., "b_ms_per_prefill_token": ..., "c_ms_per_decode_seq": ...,
"d_ms_per_kv_token": ..., "e_ms_per_attention_pair": ..., "f_ms_per_prefix_chunk": ...,
"serving_overhead_ms": ..., "serving_overhead_ms_per_in_flight": ...,
"decoder_request_overhead_ms": ..., "kv_pull_ms": ...,
"kv_pull_ms_per_mb": ..., "neighbor_slowdown": ...}` (`FittedPerf.to_json` /
`from_json`; a model saved without `e`, `f`, the overheads, the pull costs or
the slowdown reads them as 0).
Models fitted per role save as `{"roles": {"prefill": {"a_ms": ...}, ...}}`
(`roles_to_json`); `load_perf` reads either form.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from app.config import AcceleratorSpec, ModelSpec, RoleName
from app.config.file import validation_problems


class PerfModel(Protocol):
    def step_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: float, attention_pairs: float, prefix_chunks: int = 0) -> float:
        """Seconds of one step; `attention_pairs` counts (query, key) token pairs,
        `prefix_chunks` the prefill chunks that attend to tokens computed before
        them (a cached prefix, an earlier chunk)."""

    def decode_lines(self, n: int, k0: float) -> tuple[float, float, float, float]:
        """Decode-only step `k` with `n` sequences holding `k0` tokens takes
        max(p0 + p1*k, q0 + q1*k) seconds; returns (p0, p1, q0, q1)."""


class Roofline:
    """A replica of `gpus` accelerators serving one model: max(compute, memory) per step.

    Weights read per step are the active parameters of every token in the step,
    at most all parameters: a large batch touches every expert of an MoE once.
    """

    __slots__ = ("flops_s", "bytes_s", "flops_per_token", "attn_flops", "active_bytes", "total_bytes", "kv_bytes", "overhead_s")

    def __init__(self, acc: AcceleratorSpec, model: ModelSpec, gpus: int = 1):
        self.flops_s = acc.peak_tflops * 1e12 * gpus * acc.compute_efficiency
        self.bytes_s = acc.memory_bandwidth_gbps * 1e9 * gpus * acc.bandwidth_efficiency
        self.flops_per_token = 2.0 * model.active_params_b * 1e9
        self.attn_flops = model.attention_flops_per_token_pair
        self.active_bytes = model.active_params_b * 1e9 * model.weight_bytes_per_param
        self.total_bytes = (model.total_params_b or model.active_params_b) * 1e9 * model.weight_bytes_per_param
        self.kv_bytes = model.kv_read_bytes_per_token or model.kv_bytes_per_token
        self.overhead_s = acc.step_overhead_ms / 1000

    def step_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: float, attention_pairs: float, prefix_chunks: int = 0) -> float:
        # no cost per chunk: the accelerator's attention kernels read a cached prefix like any KV
        tokens = prefill_tokens + decode_seqs
        compute = (tokens * self.flops_per_token + attention_pairs * self.attn_flops) / self.flops_s
        weights = min(self.total_bytes, self.active_bytes * tokens)
        memory = (weights + kv_tokens_read * self.kv_bytes) / self.bytes_s
        return max(compute, memory) + self.overhead_s

    def decode_lines(self, n: int, k0: float) -> tuple[float, float, float, float]:
        # a decode token attends to its whole context: pairs == tokens read
        o = self.overhead_s
        c0 = (n * self.flops_per_token + k0 * self.attn_flops) / self.flops_s + o
        c1 = n * self.attn_flops / self.flops_s
        m0 = (min(self.total_bytes, self.active_bytes * n) + k0 * self.kv_bytes) / self.bytes_s + o
        m1 = n * self.kv_bytes / self.bytes_s
        return c0, c1, m0, m1


@dataclass(frozen=True)
class FittedPerf:
    """step_ms = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read + e*attention_pairs + f*prefix_chunks (all >= 0)."""

    # read by pydantic where a file is loaded (`load_perf`); the twin's hot path builds none
    __pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)
    a_ms: Annotated[float, Field(ge=0)]
    b_ms_per_prefill_token: Annotated[float, Field(ge=0)]
    c_ms_per_decode_seq: Annotated[float, Field(ge=0)]
    d_ms_per_kv_token: Annotated[float, Field(ge=0)]
    e_ms_per_attention_pair: Annotated[float, Field(ge=0)] = 0.0
    f_ms_per_prefix_chunk: Annotated[float, Field(ge=0)] = 0.0
    """Per prefill chunk that attends to tokens computed before it (a cached
    prefix, an earlier chunk of its prompt). vLLM on CPU runs such a chunk on
    another attention path than a fresh prompt, at a fixed cost of several ms:
    without this term, the short chunks after a long cached prefix that most
    agentic turns are came out 40-60% short."""
    serving_overhead_ms: Annotated[float, Field(ge=0)] = 0.0
    """Of a request entering the pipeline at this engine, the time to its first
    token spent outside the engines' queues and steps (the conductor, Serve's
    routing, the token channel, the replica's own input and output
    processing), measured in the serving app's journeys
    (app/sim/fitting.py `serving_overhead_ms`), with no other request in
    flight. The twin delays each request by it once. Not a step cost: `scaled`
    keeps it."""
    serving_overhead_ms_per_in_flight: Annotated[float, Field(ge=0)] = 0.0
    """Added to `serving_overhead_ms` for each other request in flight when a
    request arrives: the conductor and the replicas stream those requests'
    tokens on the same CPUs (app/sim/fitting.py `fit_serving_overhead`).
    `scaled` keeps it."""
    decoder_request_overhead_ms: Annotated[float, Field(ge=0)] = 0.0
    """Of each request a decoder gets after the first token came from P (a
    relay's or main decoder's continuation, MD's warm-up and extend steps),
    the time the decoder's replica spends on it outside vLLM's engine core,
    its own input and output processing (app/sim/fitting.py
    `decoder_request_overheads`); the serving overhead counts that only for
    the engines the first token waits for. The twin delays each such request
    by it. `scaled` keeps it."""
    kv_pull_ms: Annotated[float, Field(ge=0)] = 0.0
    """Each KV pull's time beyond what its link gives it (RTT, jitter, bandwidth
    shared among pulls): the KV connector's own work at both ends, measured in
    the serving app's journeys on links inside a datacenter (app/sim/fitting.py
    `fit_kv_pulls`). Several ms on vLLM-CPU's TCP transport. The twin adds it to
    every pull. `scaled` keeps it."""
    kv_pull_ms_per_mb: Annotated[float, Field(ge=0)] = 0.0
    """Added to `kv_pull_ms` per MB (1e6 bytes) pulled: the transport's own
    rate. The twin adds it on links faster than that rate; a slower link paces
    the bytes itself (app/sim/network.py `Link.set_transport`). `scaled` keeps it."""
    neighbor_slowdown: Annotated[float, Field(ge=0)] = 0.0
    """On a host whose engines share the CPU (the CPU dev cluster): each other
    engine busy while a step runs makes the step this fraction longer (the rest
    of the model is the engine with no busy neighbor). Fitted from the serving
    app's timed steps (app/sim/fitting.py `fit_to_app_steps`); 0 for an engine
    with its own accelerator. The twin puts every replica on one host when a
    model has it (app/sim/cluster.py). `scaled` keeps it."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: float, attention_pairs: float = 0.0, prefix_chunks: int = 0) -> float:
        return (
            self.a_ms
            + self.b_ms_per_prefill_token * prefill_tokens
            + self.c_ms_per_decode_seq * decode_seqs
            + self.d_ms_per_kv_token * kv_tokens_read
            + self.e_ms_per_attention_pair * attention_pairs
            + self.f_ms_per_prefix_chunk * prefix_chunks
        ) / 1000

    def decode_lines(self, n: int, k0: float) -> tuple[float, float, float, float]:
        # a decode token attends to its whole context: pairs == tokens read
        per_token = self.d_ms_per_kv_token + self.e_ms_per_attention_pair
        p0 = (self.a_ms + self.c_ms_per_decode_seq * n + per_token * k0) / 1000
        p1 = per_token * n / 1000
        return p0, p1, p0, p1

    def scaled(self, factor: float) -> FittedPerf:
        """Every step `factor` times as long."""
        return replace(
            self,
            a_ms=factor * self.a_ms,
            b_ms_per_prefill_token=factor * self.b_ms_per_prefill_token,
            c_ms_per_decode_seq=factor * self.c_ms_per_decode_seq,
            d_ms_per_kv_token=factor * self.d_ms_per_kv_token,
            e_ms_per_attention_pair=factor * self.e_ms_per_attention_pair,
            f_ms_per_prefix_chunk=factor * self.f_ms_per_prefix_chunk,
        )

    def describe(self) -> str:
        return (
            f"step = {self.a_ms:.2f} ms + {self.b_ms_per_prefill_token:.4f} ms/prefill token + "
            f"{self.c_ms_per_decode_seq:.3f} ms/decode seq + {self.d_ms_per_kv_token:.6f} ms/context token read + "
            f"{self.e_ms_per_attention_pair * 1e6:.3f} ms/M attention pairs + {self.f_ms_per_prefix_chunk:.2f} ms/chunk after a prefix"
            + (f"; x(1 + {self.neighbor_slowdown:.2f} per busy neighbor engine)" if self.neighbor_slowdown else "")
            + (f"; serving overhead {self.serving_overhead_ms:.1f} ms a request" if self.serving_overhead_ms else "")
            + (f" + {self.serving_overhead_ms_per_in_flight:.1f} ms per request in flight" if self.serving_overhead_ms_per_in_flight else "")
            + (f"; decoder request overhead {self.decoder_request_overhead_ms:.1f} ms" if self.decoder_request_overhead_ms else "")
            + (f"; KV pull {self.kv_pull_ms:.1f} ms + {self.kv_pull_ms_per_mb:.2f} ms/MB beyond its link" if self.kv_pull_ms or self.kv_pull_ms_per_mb else "")
        )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)

    @classmethod
    def from_json(cls, text: str) -> FittedPerf:
        """Raises ValueError naming each bad field."""
        try:
            return _FITTED.validate_json(text)
        except ValidationError as err:
            raise ValueError("; ".join(validation_problems(err))) from None


_FITTED = TypeAdapter(FittedPerf)


@dataclass(frozen=True)
class StepSample:
    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int
    step_ms: float
    attention_pairs: float = 0.0
    start_s: float | None = None
    """When the step started, on its host's monotonic clock (app/engine/kv/steps.py);
    None where unknown (a step timed alone, an older file)."""
    engine: str = ""
    """The engine replica that took the step, where steps of several engines are mixed."""
    prefix_chunks: int = 0
    """Prefill chunks that attended to tokens computed before them (`FittedPerf.f_ms_per_prefix_chunk`);
    0 in an older file."""


def chunk_attention_pairs(tokens: int, cached: int) -> float:
    """(query, key) pairs of a prefill chunk of `tokens` after `cached` context
    tokens: each token attends to the context and to the chunk up to itself
    (app/sim/engine.py inlines the same sum on its hot path)."""
    return tokens * cached + tokens * (tokens + 1) / 2


def roles_to_json(models: Mapping[str, FittedPerf]) -> str:
    return json.dumps({"roles": {role: model.__dict__ for role, model in models.items()}}, indent=2)


def load_perf(path: str | Path) -> FittedPerf | dict[str, FittedPerf]:
    """A saved fitted model: one for every role, or one per role (keyed by role name).
    Raises ValueError naming the file and each bad field."""
    try:
        return _perf_doc(json.loads(Path(path).read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _perf_doc(doc: object) -> FittedPerf | dict[str, FittedPerf]:
    if not isinstance(doc, dict):
        raise ValueError(f"expected a fitted model (an object), got a {type(doc).__name__}")
    if "roles" not in doc:
        return _fitted(doc)
    roles = doc["roles"]
    if not isinstance(roles, dict) or not roles:
        raise ValueError("roles: expected an object of fitted models keyed by role name")
    if unknown := sorted(set(roles) - {r.value for r in RoleName}):
        raise ValueError(f"roles.{unknown[0]}: not a role ({', '.join(r.value for r in RoleName)})")
    return {role: _fitted(model, f"roles.{role}") for role, model in roles.items()}


def _fitted(model: object, where: str = "") -> FittedPerf:
    try:
        return _FITTED.validate_python(model)
    except ValidationError as err:
        raise ValueError("; ".join(validation_problems(err, where))) from None


def load_samples(path: str | Path) -> list[StepSample]:
    doc = json.loads(Path(path).read_text())
    return [StepSample(**s) for s in doc["samples"]]


def save_samples(path: str | Path, samples: Iterable[StepSample]) -> None:
    Path(path).write_text(json.dumps({"samples": [s.__dict__ for s in samples]}, indent=1))


def fit_from_samples(samples: Iterable[StepSample | Mapping[str, Any]]) -> FittedPerf:
    """Least squares on relative errors, with non-negative coefficients.

    Relative, because measured steps span two orders of magnitude (a lone
    decode step against a full prefill budget): on absolute errors the large
    prefill steps decide every coefficient, and the model could put a small
    decode step at a fraction of its measured time.

    A coefficient that comes out negative (noise, or a column the samples never
    vary) is pinned to 0 and the rest refitted: a negative cost per token would
    make big batches faster than small ones.
    """
    import numpy as np

    rows = [s if isinstance(s, StepSample) else StepSample(**s) for s in samples]
    if len(rows) < 2:
        raise ValueError("need at least two samples to fit a step-time model")
    if bad := [r for r in rows if not r.step_ms > 0]:
        raise ValueError(f"every sample's step_ms must be > 0; got {bad[0]}")
    x = np.array([[1.0, r.prefill_tokens, r.decode_seqs, r.kv_tokens_read, r.attention_pairs, r.prefix_chunks] for r in rows])
    y = np.array([r.step_ms for r in rows])
    x, y = x / y[:, None], np.ones_like(y)
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[free] = sol
            break
        free = [f for f, v in zip(free, sol) if v >= 0] if (sol >= 0).any() else []
    return FittedPerf(*(float(c) for c in coef))


class DecodeRamp:
    """Closed-form sums of decode steps whose time is the max of two lines in the step index."""

    __slots__ = ("p0", "p1", "q0", "q1", "split", "head")

    def __init__(self, lines: tuple[float, float, float, float]):
        p0, p1, q0, q1 = lines
        if max(p0, q0) <= 0:
            raise ValueError("a decode step must take some time (perf model gives 0)")
        # order the lines so the first dominates for k < split and the second after
        # (at the crossing both are equal, so either side of it is exact)
        if p0 < q0 or (p0 == q0 and p1 < q1):
            p0, p1, q0, q1 = q0, q1, p0, p1
        split = max(0, math.ceil((p0 - q0) / (q1 - p1))) if q1 > p1 else math.inf
        if split == 0:
            p0, p1, split = q0, q1, math.inf
        self.p0, self.p1, self.q0, self.q1, self.split = p0, p1, q0, q1, split
        self.head = math.inf if split == math.inf else split * p0 + p1 * split * (split - 1) / 2

    def step(self, k: int) -> float:
        return max(self.p0 + self.p1 * k, self.q0 + self.q1 * k)

    def cum(self, m: int) -> float:
        """Seconds of steps 0 .. m-1."""
        s = self.split
        if m <= s:
            return m * self.p0 + self.p1 * m * (m - 1) / 2
        return self.head + (m - s) * self.q0 + self.q1 * (m * (m - 1) - s * (s - 1)) / 2

    def steps_within(self, t: float) -> int:
        """Most steps m with cum(m) <= t."""
        if t < self.head:
            c0, c1, base, rest = self.p0, self.p1, 0, t
        else:
            s = self.split
            assert isinstance(s, int)  # t >= head: the split is finite
            c0, c1, base, rest = self.q0 + self.q1 * s, self.q1, s, t - self.head
        if rest <= 0:
            j = 0
        elif c1 <= 0:
            j = int(rest / c0)
        else:
            b = c0 - c1 / 2
            j = int((-b + math.sqrt(b * b + 2 * c1 * rest)) / c1)
        # the float solution may be one off either way; the exact sums decide
        m = base + j
        while m > 0 and self.cum(m) > t:
            m -= 1
        while self.cum(m + 1) <= t:
            m += 1
        return m
