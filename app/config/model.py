"""The model served, and its shape for the digital twin."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from app.config.base import StrictModel


class ModelSpec(StrictModel):
    """Size figures of the served model, for the digital twin's performance model."""

    active_params_b: Annotated[float, Field(gt=0)]
    """Parameters active per token, in billions (MoE: the routed experts' share)."""
    total_params_b: Annotated[float, Field(gt=0)] | None = None
    weight_bytes_per_param: Annotated[float, Field(gt=0)] = 2.0
    """1 for FP8 weights, 2 for bf16."""
    kv_bytes_per_token: Annotated[int, Field(gt=0)]
    """KV cache bytes one token occupies (all layers): memory, and what crosses a link."""
    kv_read_bytes_per_token: Annotated[float, Field(gt=0)] | None = None
    """KV bytes attention reads per context token in one step, when less than it
    stores (sparse or compressed attention reads a fraction of the cache); None:
    all of `kv_bytes_per_token` (dense attention)."""
    attention_flops_per_token_pair: Annotated[float, Field(ge=0)] = 0.0
    """FLOPs one token spends attending to one earlier token, summed over layers
    (MHA/GQA: 4 x layers x heads x head_dim; MLA: 2 x layers x heads x (qk_dim +
    v_dim)). Makes long-context prefill quadratic in the twin; 0 ignores it."""


class ModelConfig(StrictModel):
    source: str = "devmodel"
    """`devmodel` (the tiny local Llama, built on first use), a local model folder,
    or a Hugging Face id already in the local HF cache."""
    served_name: str = "pdd-dev"
    """The `model` name clients send and `/v1/models` lists."""
    max_model_len: Annotated[int, Field(gt=0)] = 8192
    """Longest prompt + output, in tokens."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and KV dtype. float32 for the dev model keeps greedy choices stable."""
    block_size: Annotated[int, Field(gt=0)] = 32
    """KV block size in tokens, the same on every role so blocks move as they are.
    vLLM's CPU attention needs a multiple of 32."""
    load_format: Literal["auto", "dummy", "safetensors"] = "auto"
    """`dummy` gives random weights of the model's shape (GPU benchmarks)."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser for this model's chat template (its registered name, e.g.
    `hermes`), which finds calls in free text for `tool_choice: auto`; none: auto is refused."""
    spec: ModelSpec | None = None
    """Size figures for the digital twin; optional for serving."""

    @field_validator("block_size")
    @classmethod
    def _block_size_multiple_of_16(cls, v: int) -> int:
        if v % 16:
            raise ValueError("must be a multiple of 16 (32 on CPU)")
        return v
