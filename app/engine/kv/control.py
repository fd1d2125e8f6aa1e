"""Methods vLLM adds to its workers (`worker_extension_cls`), so a replica can reach
its KV connector and model runner through `AsyncLLM.collective_rpc` (start-up
checks, fault injection, operations)."""

from __future__ import annotations

from app.engine import carried_sampling

# vLLM imports this module in the worker process before the worker's first step.
carried_sampling.install()


class ConnectorControl:
    def pdd_check_sampling(self) -> str:
        """The model runner's label, once carried sampling is confirmed to run in it
        (raises CarriedSamplingUnavailable otherwise)."""
        return carried_sampling.check(self.model_runner)

    def pdd_expire_leases(self) -> int:
        """Release every lease not being pulled right now, as if its timeout had passed."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().expire_all_leases()
