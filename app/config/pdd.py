"""The whole application configuration."""

from __future__ import annotations

from pydantic import model_validator

from app.config.agents import AgentsConfig
from app.config.base import StrictModel
from app.config.cluster import ClusterConfig, NodeGroup
from app.config.knobs import HandoffConfig, LiveKnobs, RoutingConfig
from app.config.kv import KVTransferSettings
from app.config.links import LinkConfig, link_key
from app.config.model import ModelConfig
from app.config.modes import MODE_ROLES, Mode, RoleName
from app.config.roles import Roles
from app.config.security import SecurityConfig
from app.config.server import ServerConfig
from app.config.slo import SLOConfig


class PDDConfig(StrictModel):
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
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _consistent(self) -> PDDConfig:
        for role, rc in self.roles.present().items():
            if rc.node_group not in self.node_groups:
                known = ", ".join(sorted(self.node_groups)) or "none"
                raise ValueError(f"roles.{role.value}.node_group: unknown node group '{rc.node_group}' (known: {known})")
        for role in MODE_ROLES[self.mode]:
            given = self.roles.get(role)
            if given is None or given.replicas < 1:
                raise ValueError(f"roles.{role.value}: mode '{self.mode.value}' needs at least one replica")
        if self.mode in (Mode.pd_intra_dc,):
            p, d = self.datacenter_of(RoleName.prefill), self.datacenter_of(RoleName.relay_decode)
            if p != d:
                raise ValueError(f"roles.relay_decode: must share prefill's datacenter ('{p}'), not '{d}'")
        if self.mode in (Mode.pd_cross_dc_naive, Mode.pd_cross_dc, Mode.pdd) and self.roles.main_decode is not None:
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
        return self.node_groups[self.roles.of(role).node_group].datacenter

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
