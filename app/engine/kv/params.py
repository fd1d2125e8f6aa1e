"""The `kv_transfer_params` keys the conductor and the PDD connector agree on.

Kept apart from app/engine/kv/connector.py so the conductor can use them without
importing vLLM.
"""

PRODUCE = "pdd_produce"
"""To prefill: `{"consumers": n}`: keep this prompt's KV leased for n pulls."""
LEASE = "pdd_lease"
"""From prefill's final output: lease_id, host, port, num_tokens, num_blocks, datacenter."""
PULL = "pdd_pull"
"""To a decoder: a LEASE plus `relay` (host, port) and `link` name."""
