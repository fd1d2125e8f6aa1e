"""The data plane's protection: where its listeners bind, what is encrypted, how many connections a peer may hold."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Annotated

from pydantic import Field, field_validator

from app.config.base import StrictModel


class SecurityConfig(StrictModel):
    """Every data-plane connection (token streams, KV pulls, link relays) is mutual TLS with
    the cluster's own certificates (app/engine/cluster_tls.py); none of this turns that off."""

    intra_dc_encryption: bool = True
    """Encrypt KV pulls between replicas of one datacenter. Off (for RDMA-class fabric an
    operator trusts): peers still prove the cluster's certificate and send the pull request
    over TLS, then the blocks follow in plaintext. KV crossing datacenters, and every token
    stream, is always encrypted."""
    bind_host: str | None = None
    """Address the data-plane listeners bind: None binds the node's own address as Ray reports
    it. An explicit address (an interface's IP; `0.0.0.0` for all) is for hosts whose Ray
    address is not the one peers reach."""
    max_connections_per_peer: Annotated[int, Field(ge=1)] = 128
    """Connections one address may hold open to one block server or link relay; beyond it new
    ones are closed at once (logged). A link relay's pulls all come from its address, so this
    must cover every decoder's `kv.concurrent_pulls` behind one relay, or on one node without relays."""
    max_connections: Annotated[int, Field(ge=1)] = 512
    """Connections one block server or link relay holds open in all (a thread each on block servers)."""

    @field_validator("bind_host")
    @classmethod
    def _an_address(cls, value: str | None) -> str | None:
        if value is not None:
            ip_address(value)  # ValueError names the bad text; pydantic adds the field's path
        return value
