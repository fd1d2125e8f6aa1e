"""Configuration: pydantic models for everything in serve_configs/*.yaml.

One source of truth. The Serve application YAML carries a `PDDConfig` under
`applications[].args`; the live knobs (`routing`, `handoff`) also travel as the
Conductor deployment's `user_config` so they change without a restart.

Every model forbids unknown fields, so a typo fails at load with the field's
path in the message (`roles.prefill.replcas: Extra inputs are not permitted`);
app/config_file.py reads a file into these models.
"""

from __future__ import annotations

import typing
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo


class _Strict(BaseModel):
    # attribute docstrings become field descriptions: the JSON schema and chat-ops show them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class Mode(str, Enum):
    """Serving pattern for every request (a per-request override exists for benchmarks)."""

    colocated = "colocated"
    """One engine (the main_decode role) prefills and decodes."""
    pd_intra_dc = "pd_intra_dc"
    """Prefill, then relay_decode decodes the rest; both in datacenter A."""
    pd_cross_dc_naive = "pd_cross_dc_naive"
    """Prefill in A; main_decode in B receives the full prompt KV over the WAN and
    produces the first token itself, as vLLM's disaggregated-prefill proxy does."""
    pdd = "pdd"
    """Prefill / Relay-Decode / Main-Decode with hit-aware routing and handoff."""


class RoleName(str, Enum):
    prefill = "prefill"
    relay_decode = "relay_decode"
    main_decode = "main_decode"


#: Which roles each mode needs.
MODE_ROLES: dict[Mode, tuple[RoleName, ...]] = {
    Mode.colocated: (RoleName.main_decode,),
    Mode.pd_intra_dc: (RoleName.prefill, RoleName.relay_decode),
    Mode.pd_cross_dc_naive: (RoleName.prefill, RoleName.main_decode),
    Mode.pdd: (RoleName.prefill, RoleName.relay_decode, RoleName.main_decode),
}


class ModelSpec(_Strict):
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


class ModelConfig(_Strict):
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
    spec: ModelSpec | None = None
    """Size figures for the digital twin; optional for serving."""

    @field_validator("block_size")
    @classmethod
    def _block_size_multiple_of_16(cls, v: int) -> int:
        if v % 16:
            raise ValueError("must be a multiple of 16 (32 on CPU)")
        return v


class AcceleratorSpec(_Strict):
    """Performance figures of one accelerator, for the digital twin's roofline."""

    peak_tflops: Annotated[float, Field(gt=0)]
    """Dense bf16 peak, TFLOP/s."""
    memory_bandwidth_gbps: Annotated[float, Field(gt=0)]
    """HBM bandwidth, GB/s."""
    memory_gib: Annotated[float, Field(gt=0)]
    """Device memory of one accelerator; the twin's KV capacity is what the
    replica's accelerators hold beyond the weights."""
    compute_efficiency: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Fraction of `peak_tflops` a whole engine step reaches (model FLOPs
    utilisation); 1 is the pure roofline."""
    bandwidth_efficiency: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Fraction of `memory_bandwidth_gbps` weight and KV reads reach."""
    step_overhead_ms: Annotated[float, Field(ge=0)] = 0.0
    """Fixed cost of one engine step (scheduling, launches, collectives)."""


class NodeGroup(_Strict):
    """A pool of identical machines in one datacenter."""

    datacenter: str
    """Datacenter name; links are declared between datacenters."""
    accelerator: str = "cpu"
    """Accelerator type, e.g. `cpu`, `H100`, `H200`."""
    resources: dict[str, float] = {}
    """Ray custom resources each replica of a role on this group asks for
    (e.g. `{dc_a: 0.01}`); the nodes of the group must offer them."""
    labels: dict[str, str] = {}
    """Ray node labels each replica must match (label selector)."""
    num_cpus: Annotated[float, Field(ge=0)] = 0.25
    """CPUs per replica as Ray accounts them (fractional: on 2 cores several
    deployments must fit)."""
    num_gpus: Annotated[float, Field(ge=0)] = 0
    """GPUs per replica (tensor parallel size on GPU machines), or a share of one
    (e.g. 0.3: several roles' engines on one card, each with its
    `engine.gpu_memory_utilization`)."""
    cost_per_hour: Annotated[float, Field(ge=0)] = 0.0
    """Cost of one replica's hardware per hour, for BCR (goodput / cost)."""
    spec: AcceleratorSpec | None = None
    """Performance figures for the digital twin; optional for serving."""

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus_above_one(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"{v:g}: a share of one GPU (at most 1) or whole GPUs, not a share of several")
        return v


class EngineConfig(_Strict):
    """Per-role vLLM engine arguments."""

    kv_cache_gib: Annotated[float, Field(gt=0)] = 1.0
    """KV cache size. On CPU this sets VLLM_CPU_KVCACHE_SPACE for the engine."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """GPU machines only."""
    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    """Decode batch limit."""
    max_num_batched_tokens: Annotated[int, Field(gt=0)] | None = None
    """Chunked-prefill token budget per step (vLLM's default when unset)."""
    enforce_eager: bool = True
    """No graph capture: engine start ~30 s instead of ~70 s on CPU."""
    tensor_parallel_size: Annotated[int, Field(gt=0)] = 1
    model_runner: Literal["v1", "v2", "auto"] = "v1"
    """vLLM's model runner, set through VLLM_USE_V2_MODEL_RUNNER before the engine starts
    (whatever the environment says). `auto` is vLLM's own choice: V2 wherever Triton
    runs, i.e. on every CUDA machine. Only `v1` is accepted while carried sampling
    (app/carried_sampling.py) hooks V1's runner; each engine checks the runner it got."""
    record_steps: bool = False
    """Time each engine step and keep its shape (app/kv/steps.py), to fit the twin's
    step model to steps taken while the app serves (app/sim/calibrate.py)."""
    extra: dict[str, Any] = {}
    """Any other `vllm.AsyncEngineArgs` field, passed through as is."""

    @field_validator("model_runner")
    @classmethod
    def _runner_carries_sampling(cls, v: str) -> str:
        if v != "v1":
            raise ValueError(
                f"'{v}' is not supported yet: seeded sampling and presence/frequency penalties that carry "
                "across engines (app/carried_sampling.py) hook vLLM's V1 model runner, and under V2 a request "
                "moved between engines (handoff, relay, failover) would sample other tokens than one engine does; use 'v1'"
            )
        return v

    @field_validator("extra")
    @classmethod
    def _extra_are_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        import dataclasses

        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
        except ImportError:  # validating a config on a machine without vLLM
            return v
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"not vLLM engine arguments: {', '.join(unknown)}")
        reserved = sorted(set(v) & {"model", "kv_transfer_config", "block_size", "dtype", "worker_extension_cls"})
        if reserved:
            raise ValueError(f"set by pdd-serve, not here: {', '.join(reserved)}")
        return v


class RoleConfig(_Strict):
    node_group: str
    """Name of a node group in `node_groups`."""
    replicas: Annotated[int, Field(ge=0)] = 1
    """Initial replica count (later changed through Serve's scale endpoint)."""
    max_replicas: Annotated[int, Field(ge=1)] = 8
    """Upper bound for scaling (agents respect it)."""
    engine: EngineConfig = EngineConfig()


class Roles(_Strict):
    prefill: RoleConfig | None = None
    relay_decode: RoleConfig | None = None
    main_decode: RoleConfig | None = None

    def get(self, role: RoleName) -> RoleConfig | None:
        return getattr(self, role.value)

    def present(self) -> dict[RoleName, RoleConfig]:
        return {r: c for r in RoleName if (c := self.get(r)) is not None}


class JitterConfig(_Strict):
    """Per-transfer extra latency, drawn from a seeded distribution."""

    distribution: Literal["none", "normal", "lognormal", "exponential", "pareto"] = "none"
    mean_ms: Annotated[float, Field(ge=0)] = 0.0
    """Mean of the extra latency."""
    std_ms: Annotated[float, Field(ge=0)] = 0.0
    """Spread (normal, lognormal); ignored by exponential; pareto uses `pareto_shape`."""
    pareto_shape: Annotated[float, Field(gt=1)] = 2.5
    max_ms: Annotated[float, Field(ge=0)] = 30_000.0
    """Cap, so one draw cannot stall a transfer forever."""


class StallConfig(_Strict):
    """Random stalls: a transfer pauses mid-stream (TCP retransmit storms, congestion)."""

    probability: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Chance that one transfer stalls once."""
    duration_ms: Annotated[float, Field(ge=0)] = 0.0


class LinkConfig(_Strict):
    """A network path between two datacenters (or within one), emulated in user space."""

    between: tuple[str, str]
    """The two datacenters (equal for the intra-datacenter link). Symmetric."""
    bandwidth_mbps: Annotated[float, Field(gt=0)]
    """Throughput available to KV transfers, megabits per second."""
    rtt_ms: Annotated[float, Field(ge=0)] = 0.0
    """Base round-trip time; one RTT is paid per pull before bytes flow."""
    jitter: JitterConfig = JitterConfig()
    stall: StallConfig = StallConfig()
    seed: int = 0
    """Seed of the jitter and stall draws (reproducible runs)."""

    @property
    def key(self) -> tuple[str, str]:
        return link_key(*self.between)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def mean_latency_s(self) -> float:
        """What a pull waits on this link besides its bytes, on average: RTT, mean jitter, mean stall.

        The configured jitter and stalls are part of the model: a link that behaves
        exactly as configured must not read as degraded."""
        jitter_ms = self.jitter.mean_ms if self.jitter.distribution != "none" else 0.0
        return (self.rtt_ms + jitter_ms + self.stall.probability * self.stall.duration_ms) / 1000


def link_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class SingularFilterConfig(_Strict):
    """Ultra-long, low-hit input with ultra-short output finishes on RLD (P-RLD).

    The only exception to "every request ends at MD"; must stay rare.
    """

    enabled: bool = True
    min_prompt_tokens: Annotated[int, Field(ge=1)] = 4096
    """Only prompts at least this long."""
    max_hit_rate: Annotated[float, Field(ge=0, le=1)] = 0.2
    """Only when MD's expected prefix hit is at most this."""
    max_output_tokens: Annotated[int, Field(ge=1)] = 16
    """Only when the request asks for at most this many tokens."""


class RoutingConfig(_Strict):
    """Live knob: which pipeline a request takes (conductor user_config)."""

    max_wan_transfer_ms: Annotated[float, Field(ge=0)] = 300.0
    """P-MD when the expected WAN transfer (blocks MD lacks x bytes / bandwidth
    + RTT) is at most this; above it P-RLD-MD masks the transfer with a relay."""
    min_hit_rate: Annotated[float, Field(ge=0, le=1)] | None = None
    """Alternative form of the threshold: when set, P-MD also requires MD's
    expected prefix hit to be at least this."""
    max_relay_load: Annotated[float, Field(gt=0, le=1)] = 0.9
    """RLD occupancy (active relays / max_num_seqs) above which new requests
    skip the relay (P-MD) rather than overload RLD."""
    prefill_relays: bool = True
    """While no relay decoder is alive (its replica died and Serve is replacing
    it, or none is deployed), the prefill replica that computed a request's
    prompt relays it (P-P-MD) where P-RLD-MD would have been taken: the client
    sees P's tokens while MD pulls, not the WAN pull as a gap. P then decodes
    besides prefilling (at most the relay cap, scaled by P's own occupancy);
    false sends those requests P-MD."""
    singular: SingularFilterConfig = SingularFilterConfig()


class HandoffMode(str, Enum):
    one_shot = "one_shot"
    catch_up = "catch_up"
    auto = "auto"


class HandoffConfig(_Strict):
    """Live knob: how RLD hands a request over to MD (conductor user_config)."""

    mode: HandoffMode = HandoffMode.auto
    """one_shot: all eager tokens at once; catch_up: a first slice warms MD while
    RLD continues, then the rest; auto: catch_up only past the threshold."""
    catch_up_threshold_tokens: Annotated[int, Field(ge=1)] = 64
    """In auto mode, eager tokens beyond which the handoff goes in two steps."""
    relay_cap_tokens: Annotated[int, Field(ge=1)] = 512
    """Most tokens RLD produces for one request. The cap shrinks with RLD load
    (dynamic cap); at the cap RLD stops and MD resumes once it holds the KV."""
    min_relay_cap_tokens: Annotated[int, Field(ge=1)] = 32
    """The dynamic cap never drops below this."""

    @model_validator(mode="after")
    def _caps_ordered(self) -> HandoffConfig:
        if self.min_relay_cap_tokens > self.relay_cap_tokens:
            raise ValueError("min_relay_cap_tokens must not exceed relay_cap_tokens")
        return self


class PullOrder(str, Enum):
    """Which waiting pull a decoding engine's next free pull thread takes."""

    smallest_first = "smallest_first"
    """Fewest blocks first, ties in arrival order: a high-hit turn's few missing
    blocks (a P-MD client waiting on them, or a relay held past its turn) never
    queue behind cold prompts' pulls. A large pull waits while smaller ones keep
    arriving, so it moves when the link has slack."""
    arrival = "arrival"
    """First come, first served."""


class KVTransferSettings(_Strict):
    """How KV blocks move between engines."""

    lease_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """Prefill keeps a finished prompt's blocks this long for decoders to pull."""
    connect_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    transfer_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """A pull not done by then is abandoned; the decoder recomputes."""
    concurrent_pulls: Annotated[int, Field(ge=1)] = 8
    """Pulls one decoding engine runs at once (its connector's pull threads); the
    others wait their turn (`pull_order`), and that wait is not part of a
    transfer's `seconds` (it is its `queued_seconds`). Fewer at once: each pull on
    a slow link finishes sooner, but the waiting ones wait longer."""
    pull_order: PullOrder = PullOrder.smallest_first
    """Which waiting pull goes next when a pull thread frees."""


class SLOConfig(_Strict):
    ttft_ms: Annotated[float, Field(gt=0)] = 2000.0
    """Time to first token target."""
    tpot_ms: Annotated[float, Field(gt=0)] = 200.0
    """Mean time per output token (after the first) target."""
    max_gap_ms: Annotated[float, Field(gt=0)] = 1000.0
    """Worst inter-token gap target (handoffs and transfers show up here)."""
    percentile: Annotated[float, Field(gt=0, lt=100)] = 90.0
    """The percentile the targets apply to."""
    window_s: Annotated[float, Field(gt=0)] = 300.0
    """Evaluation window for recording rules and agents."""


class AgentMode(str, Enum):
    observe = "observe"
    advise = "advise"
    act = "act"


class KnobBounds(_Strict):
    min: float
    max: float
    max_step: Annotated[float, Field(gt=0)]
    """Largest change per action."""

    @model_validator(mode="after")
    def _ordered(self) -> KnobBounds:
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        return self


class LLMEndpoint(_Strict):
    base_url: str
    """Any OpenAI-compatible endpoint (may be this cluster)."""
    model: str
    api_key_env: str = "PDD_AGENT_LLM_API_KEY"
    """Name of the environment variable holding the key (never the key itself)."""


class AgentsConfig(_Strict):
    mode: AgentMode = AgentMode.observe
    tick_s: Annotated[float, Field(gt=0)] = 30.0
    cooldown_s: Annotated[float, Field(ge=0)] = 120.0
    """Minimum time between two changes of the same knob."""
    verify_after_s: Annotated[float, Field(ge=0)] = 60.0
    """How long after acting the SLO is checked again (roll back if worse)."""
    replica_start_s: Annotated[float, Field(ge=0)] = 300.0
    """How long a replica the agents add may take to come up (engine start, weights)
    before the shortfall counts as a crash; for this long plus `cooldown_s` the role
    is not judged idle either (its new replica has not drawn its share of the load)."""
    prometheus_url: str = "http://127.0.0.1:9090"
    bounds: dict[str, KnobBounds] = {
        "routing.max_wan_transfer_ms": KnobBounds(min=0, max=5000, max_step=200),
        "handoff.catch_up_threshold_tokens": KnobBounds(min=8, max=512, max_step=64),
        "handoff.relay_cap_tokens": KnobBounds(min=32, max=4096, max_step=256),
        "routing.min_hit_rate": KnobBounds(min=0, max=0.95, max_step=0.1),
        "routing.singular.min_prompt_tokens": KnobBounds(min=1024, max=65536, max_step=4096),
    }
    """Per-knob bounds; replica bounds come from each role's max_replicas.
    A numeric knob without bounds here is never changed by the agents."""
    llm: LLMEndpoint | None = None
    """None: the swarm runs rule-routed and chat-ops says how to configure one."""
    audit_db: str = "~/.cache/pdd-serve/agents.sqlite"
    chat_db: str = "~/.cache/pdd-serve/chatops.sqlite"
    """Chat-ops conversations (`pdd ask`, POST /pdd/chat): a LangGraph checkpointer, one thread per conversation."""
    actions_dir: str = "runbooks/actions"
    dashboard_url: str = "http://127.0.0.1:8265"
    """Ray dashboard the agents actuate through (Serve REST API: redeploy, scale)."""
    prometheus_matchers: dict[str, str] = {}
    """Label matchers added to every agent query, e.g. `{job: ray-prod}` when one
    Prometheus scrapes several clusters."""
    confirm_ticks: Annotated[int, Field(ge=1)] = 2
    """Consecutive ticks a situation must persist before a change is proposed
    (hysteresis: one noisy scrape never moves a knob)."""
    regression_tolerance: Annotated[float, Field(gt=0, le=1)] = 0.1
    """Relative worsening of the SLO score (worst figure / target) after a change
    that makes the agents roll it back."""
    max_cost_per_hour: Annotated[float, Field(gt=0)] | None = None
    """Ceiling on the fleet's hardware cost (replicas x their node group's
    cost_per_hour, summed over roles). The agents never scale past it; a role
    that must grow at the ceiling gets a replica moved from another role.
    None: no ceiling (each role is still bounded by its max_replicas)."""

    @field_validator("bounds")
    @classmethod
    def _bounds_name_numeric_knobs(cls, v: dict[str, KnobBounds]) -> dict[str, KnobBounds]:
        for path in v:
            model: type[BaseModel] = LiveKnobs
            *parents, leaf = path.split(".")
            for part in parents:
                field = model.model_fields.get(part)
                if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                    raise ValueError(f"'{path}' is not a live knob (routing.* or handoff.*)")
                model = field.annotation
            field = model.model_fields.get(leaf)
            if field is None or not _is_numeric(field.annotation):
                raise ValueError(f"'{path}' is not a numeric live knob (routing.* or handoff.*)")
        return v


def _is_numeric(annotation: Any) -> bool:
    """int/float, also inside Annotated[...] and Optional[...] (as `min_hit_rate` is)."""
    if annotation in (int, float):
        return True
    return any(_is_numeric(a) for a in typing.get_args(annotation) if not isinstance(a, FieldInfo))


class ServerConfig(_Strict):
    api_keys: list[str] = []
    """Bearer keys accepted by the API; empty and no PDD_API_KEYS env: no auth."""
    max_prompt_tokens: Annotated[int, Field(gt=0)] | None = None
    """Longest prompt accepted (default: max_model_len - 1)."""
    max_output_tokens: Annotated[int, Field(gt=0)] = 4096
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    """max_tokens when a request gives none."""
    max_concurrent_per_key: Annotated[int, Field(gt=0)] = 256
    """Choices in flight for one API key beyond which new requests get 429."""
    max_queued_requests: Annotated[int, Field(gt=0)] = 1024
    """Choices in flight in one conductor replica beyond which new requests get 429."""
    max_choices_per_request: Annotated[int, Field(gt=0)] = 128
    """Most choices one request may ask for (`n` times its prompts); each is one engine request.
    A request asking for more is refused with 400, naming `n` or `prompt`."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    allow_mode_override: bool = True
    """Accept a per-request `pdd_mode` (benchmarks, tests)."""
    http_port: Annotated[int, Field(gt=0, lt=65536)] = 8000


class ClusterConfig(_Strict):
    emulated: bool = False
    """Both datacenters may share one Ray node: when the cluster lacks a node
    group's resources, roles are placed anywhere (links still emulate the WAN).
    When false, a missing resource is an error naming the node group."""


class PDDConfig(_Strict):
    """The whole application configuration."""

    mode: Mode = Mode.pdd
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    node_groups: dict[str, NodeGroup]
    roles: Roles
    links: list[LinkConfig] = []
    routing: RoutingConfig = RoutingConfig()
    handoff: HandoffConfig = HandoffConfig()
    kv: KVTransferSettings = KVTransferSettings()
    slo: SLOConfig = SLOConfig()
    agents: AgentsConfig = AgentsConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _consistent(self) -> PDDConfig:
        for role, rc in self.roles.present().items():
            if rc.node_group not in self.node_groups:
                known = ", ".join(sorted(self.node_groups)) or "none"
                raise ValueError(f"roles.{role.value}.node_group: unknown node group '{rc.node_group}' (known: {known})")
        for role in MODE_ROLES[self.mode]:
            rc = self.roles.get(role)
            if rc is None or rc.replicas < 1:
                raise ValueError(f"roles.{role.value}: mode '{self.mode.value}' needs at least one replica")
        if self.mode in (Mode.pd_intra_dc,):
            p, d = self.datacenter_of(RoleName.prefill), self.datacenter_of(RoleName.relay_decode)
            if p != d:
                raise ValueError(f"roles.relay_decode: must share prefill's datacenter ('{p}'), not '{d}'")
        if self.mode in (Mode.pd_cross_dc_naive, Mode.pdd) and self.roles.main_decode is not None:
            p, d = self.datacenter_of(RoleName.prefill), self.datacenter_of(RoleName.main_decode)
            if p == d:
                raise ValueError(f"roles.main_decode: mode '{self.mode.value}' needs it in another datacenter than prefill ('{p}')")
        declared = {lc.key for lc in self.links}
        if len(declared) != len(self.links):
            raise ValueError("links: two links declared between the same datacenters")
        for a, b in self.datacenter_pairs_used():
            if link_key(a, b) not in declared:
                raise ValueError(f"links: no link declared between '{a}' and '{b}'")
        if self.server.max_prompt_tokens is not None and self.server.max_prompt_tokens >= self.model.max_model_len:
            raise ValueError("server.max_prompt_tokens: must be below model.max_model_len")
        return self

    def datacenter_of(self, role: RoleName) -> str:
        rc = self.roles.get(role)
        if rc is None:
            raise KeyError(role)
        return self.node_groups[rc.node_group].datacenter

    def datacenter_pairs_used(self) -> set[tuple[str, str]]:
        """Datacenter pairs KV may cross between the roles present."""
        present = self.roles.present()
        if RoleName.prefill not in present:
            return set()
        p = self.datacenter_of(RoleName.prefill)
        return {link_key(p, self.datacenter_of(r)) for r in present if r is not RoleName.prefill}

    def link(self, a: str, b: str) -> LinkConfig:
        key = link_key(a, b)
        for lc in self.links:
            if lc.key == key:
                return lc
        raise KeyError(f"no link between '{a}' and '{b}'")

    def live_knobs(self) -> LiveKnobs:
        return LiveKnobs(routing=self.routing, handoff=self.handoff)

    @property
    def max_prompt_tokens(self) -> int:
        return self.server.max_prompt_tokens or self.model.max_model_len - 1


class LiveKnobs(_Strict):
    """What the Conductor deployment's user_config carries (changed without restart)."""

    routing: RoutingConfig = RoutingConfig()
    handoff: HandoffConfig = HandoffConfig()
