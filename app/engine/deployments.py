"""The three role deployments: Prefill, RelayDecode, MainDecode (thin wrappers).

All work is in app/engine/replica.py; a role only fixes which config section its
engine comes from. Placement (node group resources / labels) and replica
counts are applied by app/builder.py.
"""

from __future__ import annotations

from ray import serve

from app.config import PDDConfig, RoleName
from app.engine.replica import EngineServer
from app.telemetry.replica_logging import log_to_stderr

#: Serve deployment name of each role.
DEPLOYMENT_NAMES: dict[RoleName, str] = {
    RoleName.prefill: "Prefill",
    RoleName.relay_decode: "RelayDecode",
    RoleName.main_decode: "MainDecode",
}


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class _RoleServer(EngineServer):
    role: RoleName

    # Serve awaits an async constructor: the replica is not up until its runner is checked.
    async def __init__(self, config: dict):  # type: ignore[misc]
        log_to_stderr()
        super().__init__(PDDConfig.model_validate(config), self.role, _replica_id())
        await self.check_runner()

    def __del__(self):
        if hasattr(self, "engine"):  # construction may have failed
            self.shutdown()


@serve.deployment(name=DEPLOYMENT_NAMES[RoleName.prefill])
class PrefillServer(_RoleServer):
    role = RoleName.prefill


@serve.deployment(name=DEPLOYMENT_NAMES[RoleName.relay_decode])
class RelayDecodeServer(_RoleServer):
    role = RoleName.relay_decode


@serve.deployment(name=DEPLOYMENT_NAMES[RoleName.main_decode])
class MainDecodeServer(_RoleServer):
    role = RoleName.main_decode


ROLE_DEPLOYMENTS = {
    RoleName.prefill: PrefillServer,
    RoleName.relay_decode: RelayDecodeServer,
    RoleName.main_decode: MainDecodeServer,
}
