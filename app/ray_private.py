"""The Ray internals pdd-serve relies on, in one place, each with why no public API serves.

Ray 2.60 has no public equivalent for these; an upgrade that moves one breaks here only.
- The GCS key-value store (`ray.experimental.internal_kv`): the conductor saves its prefix
  index there so that the next conductor starts from it; the data plane's TLS credentials
  are handed to replicas there (app/engine/cluster_tls.py), and so is the API key generated
  when none is configured (app/api/auth.py). Public alternatives (a named
  actor, a Serve deployment) would die with the cluster's nodes; the GCS outlives them.
- The dashboard's auth header (`ray._private.authentication`): the agents call Serve's
  REST API on a cluster with token auth, as Ray's own dashboard SDK does.
- The address Serve's HTTP proxies bind (`ServeControllerClient.http_config`): the ingress
  asks for API keys when it binds beyond loopback; no public API reports `http_options`.
- A request router's deployment name (`RequestRouter._deployment_id`): the affinity
  router publishes each deployment's live replicas, including "none left", when no
  replica is there to name the deployment.
"""

from __future__ import annotations

from typing import Any


def kv_keys(prefix: str, namespace: str) -> list[bytes]:
    from ray.experimental import internal_kv

    return list(internal_kv._internal_kv_list(prefix, namespace=namespace))


def kv_get(key: bytes | str, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: bytes, namespace: str, *, overwrite: bool = True) -> bool:
    """`overwrite=False`: put only if absent (the first of concurrent writers wins).
    Returns whether the key held a value already."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_put(key, value, overwrite=overwrite, namespace=namespace))


def kv_delete(key: str, namespace: str, *, by_prefix: bool = False) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=namespace)


def dashboard_auth_headers() -> dict[str, str]:
    """The header Ray's dashboard SDK sends; empty when the cluster has auth off."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    return dict(get_auth_headers_if_auth_enabled({}))


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (`http_options.host`), as this cluster's Serve
    controller holds it; None: Serve runs no HTTP proxy."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # it raises when no controller runs
    return client.http_config.host


def router_deployment_name(router: Any) -> str:
    """The deployment a request router routes for."""
    return router._deployment_id.name
