"""Node groups (machines per datacenter) and how the cluster is used."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from app.config.base import StrictModel


class AcceleratorSpec(StrictModel):
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


class NodeGroup(StrictModel):
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


class ClusterConfig(StrictModel):
    emulated: bool = False
    """Both datacenters may share one Ray node: when the cluster lacks a node
    group's resources, roles are placed anywhere (links still emulate the WAN).
    When false, a missing resource is an error naming the node group."""
