"""vLLM's arguments for a role's engine, from the config alone."""

from __future__ import annotations

from typing import Any

from app.config import PDDConfig, RoleName
from app.engine.cluster_tls import credentials_file
from app.engine.devmodel import resolve_model_source


def kv_transfer_config(config: PDDConfig, role: RoleName, host: str, block_port: int, owner_pid: int):
    """Every role loads the PDD connector: any engine may produce or consume KV."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="PDDConnector",
        kv_connector_module_path="app.engine.kv.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "datacenter": config.datacenter_of(role),
            "host": host,
            "block_port": block_port,
            "lease_timeout_s": config.kv.lease_timeout_s,
            "connect_timeout_s": config.kv.connect_timeout_s,
            "transfer_timeout_s": config.kv.transfer_timeout_s,
            "concurrent_pulls": config.kv.concurrent_pulls,
            "pull_order": config.kv.pull_order.value,
            "owner_pid": owner_pid,
            "record_steps": config.roles.of(role).engine.record_steps,
            "tls_credentials": credentials_file(),
            "bind_host": config.security.bind_host,
            "intra_dc_encryption": config.security.intra_dc_encryption,
            "max_connections_per_peer": config.security.max_connections_per_peer,
            "max_connections": config.security.max_connections,
        },
    )


def engine_args(config: PDDConfig, role: RoleName, kv_transfer_config: Any = None):
    """AsyncEngineArgs for one role, from the config alone."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    e = config.roles.of(role).engine
    kwargs: dict[str, Any] = dict(
        model=resolve_model_source(config.model.source),
        served_model_name=config.model.served_name,
        dtype=config.model.dtype,
        block_size=config.model.block_size,
        max_model_len=config.model.max_model_len,
        enable_prefix_caching=True,
        enforce_eager=e.enforce_eager,
        max_num_seqs=e.max_num_seqs,
        tensor_parallel_size=e.tensor_parallel_size,
        gpu_memory_utilization=e.gpu_memory_utilization,
        load_format=config.model.load_format,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
        worker_extension_cls="app.engine.kv.control.ConnectorControl",
    )
    if e.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = e.max_num_batched_tokens
    if e.tensor_parallel_size > 1:  # workers go into the replica's placement group (app/builder.py)
        kwargs["distributed_executor_backend"] = "ray"
    # xgrammar: the backend the ingress checks constraints with (app/api/structured.py). The
    # random-weight dev model picks whitespace between JSON tokens as often as anything else.
    so = {"backend": "xgrammar", "disable_any_whitespace": config.model.source == "devmodel", **e.extra.get("structured_outputs_config", {})}
    kwargs.update(e.extra)
    kwargs["structured_outputs_config"] = StructuredOutputsConfig(**so)
    return AsyncEngineArgs(**kwargs)
