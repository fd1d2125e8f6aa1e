"""Configuration: pydantic models for everything in serve_configs/*.yaml, one module per section.

One source of truth. The Serve application YAML carries a `PDDConfig` (pdd.py)
under `applications[].args`; the live knobs (`routing`, `handoff`: knobs.py)
also travel as the Conductor deployment's `user_config` so they change without
a restart.

Every model forbids unknown fields, so a typo fails at load with the field's
path in the message (`roles.prefill.replcas: Extra inputs are not permitted`);
app/config/file.py reads a file into these models. Each field is documented
where it is declared, and that text is its description (base.py).
"""

from __future__ import annotations

from app.config.agents import AgentMode, AgentsConfig, KnobBounds, LLMEndpoint
from app.config.cluster import AcceleratorSpec, ClusterConfig, NodeGroup
from app.config.knobs import HandoffConfig, HandoffMode, LiveKnobs, RoutingConfig, SingularFilterConfig
from app.config.kv import KVTransferSettings, PullOrder
from app.config.links import JitterConfig, LinkConfig, StallConfig, link_key
from app.config.model import ModelConfig, ModelSpec
from app.config.modes import MODE_ROLES, Mode, RoleName
from app.config.pdd import PDDConfig
from app.config.roles import EngineConfig, RoleConfig, Roles
from app.config.security import SecurityConfig
from app.config.server import ServerConfig
from app.config.slo import SLOConfig

__all__ = [
    "AcceleratorSpec",
    "AgentMode",
    "AgentsConfig",
    "ClusterConfig",
    "EngineConfig",
    "HandoffConfig",
    "HandoffMode",
    "JitterConfig",
    "KVTransferSettings",
    "KnobBounds",
    "LLMEndpoint",
    "LinkConfig",
    "LiveKnobs",
    "MODE_ROLES",
    "Mode",
    "ModelConfig",
    "ModelSpec",
    "NodeGroup",
    "PDDConfig",
    "PullOrder",
    "RoleConfig",
    "RoleName",
    "Roles",
    "RoutingConfig",
    "SLOConfig",
    "SecurityConfig",
    "ServerConfig",
    "SingularFilterConfig",
    "StallConfig",
    "link_key",
]
