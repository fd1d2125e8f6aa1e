"""Serving modes and the roles each one runs."""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """Serving pattern for every request (a per-request override exists for benchmarks)."""

    colocated = "colocated"
    """One engine (the main_decode role) prefills and decodes."""
    pd_intra_dc = "pd_intra_dc"
    """Prefill, then relay_decode decodes the rest; both in datacenter A."""
    pd_cross_dc_naive = "pd_cross_dc_naive"
    """Prefill in A; main_decode in B receives the full prompt KV over the WAN and
    produces the first token itself, as vLLM's disaggregated-prefill proxy does."""
    pd_cross_dc = "pd_cross_dc"
    """Cross-datacenter PD as vLLM's NIXL and Mooncake connectors ship it: prefill in A;
    main_decode in B pulls only the blocks its own prefix cache lacks and produces the
    first token; a conversation's turns stick to their decoder. No relay, no handoff."""
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
    Mode.pd_cross_dc: (RoleName.prefill, RoleName.main_decode),
    Mode.pdd: (RoleName.prefill, RoleName.relay_decode, RoleName.main_decode),
}
