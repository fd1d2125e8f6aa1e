"""Methods vLLM adds to its workers (`worker_extension_cls`), so a replica can reach
its KV connector and model runner through `AsyncLLM.collective_rpc` (start-up
checks, fault injection, operations)."""

from __future__ import annotations

from typing import Any

from app.engine import carried_sampling

# vLLM imports this module in the worker process before the worker's first step.
carried_sampling.install()


class ConnectorControl:
    model_runner: Any  # vLLM's worker, which this extends

    def pdd_check_sampling(self) -> str:
        """The model runner's label, once carried sampling is confirmed to run in it
        (raises CarriedSamplingUnavailable otherwise)."""
        return carried_sampling.check(self.model_runner)

    def pdd_expire_leases(self) -> int:
        """Release every lease not being pulled right now, as if its timeout had passed."""
        return _connector().expire_all_leases()

    def pdd_block_server_state(self) -> dict[str, int]:
        """The block server's open and refused connections, leases held, and this worker process's threads."""
        return _connector().block_server_state()


def _connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from app.engine.kv.connector import PDDConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, PDDConnector)
    return connector
