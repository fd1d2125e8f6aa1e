"""What a deployment opens, and to whom: `pdd validate` (from the config alone) and `pdd status`
(adding what the running app reports).

Pure functions of a PDDConfig and the Serve config document (whose `http_options` say where
Serve's HTTP ingress binds); `render` makes the rich table both commands print. The API's
rule (app/api/auth.py): keys of either scope configured, they are required; none, the API is
open while Serve binds loopback only, and beyond it takes only the cluster's generated operator
key unless `server.allow_anonymous`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any
from urllib.parse import urlparse

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from app.api.auth import is_loopback, key_file
from app.config import PDDConfig, ServerConfig
from app.ops.cluster import DASHBOARD_PORT
from app.ops.haproxy import ADMIN_HOST_VAR

#: Where Serve's HTTP ingress binds when the Serve config says nothing (ray.serve.config.HTTPOptions).
SERVE_DEFAULT_HOST, SERVE_DEFAULT_PORT = "127.0.0.1", 8000
#: Ray's defaults (RAY_SERVE_HAPROXY_STATS_PORT, RAY_SERVE_HAPROXY_METRICS_PORT).
HAPROXY_STATS_PORT, HAPROXY_EXPORTER_PORT = 8404, 9101


@dataclass(frozen=True)
class Row:
    what: str
    where: str
    access: str
    """Who may use it, and whether what crosses it is encrypted."""


@dataclass
class Exposure:
    rows: list[Row] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def http_address(doc: Mapping[str, Any]) -> tuple[str | None, int]:
    """(host, port) Serve's HTTP ingress binds, from a Serve config document; a bare PDD config
    has none, and Serve's defaults apply. A None host: Serve runs no HTTP ingress."""
    http = doc.get("http_options") or {}
    return http.get("host", SERVE_DEFAULT_HOST), int(http.get("port") or SERVE_DEFAULT_PORT)


def _env_keys(environ: Mapping[str, str], name: str) -> set[str]:
    return {k.strip() for k in environ.get(name, "").split(",") if k.strip()}


def api_access(server: ServerConfig, host: str | None, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(who may call the API, a warning or None), as the ingress decides it (app/api/auth.py):
    the config's keys plus PDD_API_KEYS / PDD_OPERATOR_API_KEYS of `environ` (the shell that starts
    the cluster passes its own to the replicas)."""
    operator = set(server.operator_api_keys) | _env_keys(environ, "PDD_OPERATOR_API_KEYS")
    inference = (set(server.api_keys) | _env_keys(environ, "PDD_API_KEYS")) - operator
    if inference or operator:
        return f"bearer keys: {len(inference)} inference, {len(operator)} operator", None
    if is_loopback(host):
        return "no key: loopback only, none configured", None
    if server.allow_anonymous:
        return "ANYONE, no key (server.allow_anonymous)", (
            f"the API binds {host} with no key and server.allow_anonymous: anyone who reaches it may call "
            "every endpoint (completions, every user's journeys, /pdd/chat)"
        )
    return f"the cluster's generated operator key (in {key_file()} on the ingress host, and Ray's GCS)", None


def data_plane(config: PDDConfig) -> tuple[list[Row], list[str]]:
    """The replicas' own listeners (a token channel and a KV block server per engine replica, a
    link relay per receiving datacenter), and warnings on how the config opens them."""
    sec = config.security
    inside = "on" if sec.intra_dc_encryption else "OFF (security.intra_dc_encryption)"
    rows = [
        Row("data plane (tokens, KV, relays)", sec.bind_host or "each node's own address", "mutual TLS 1.3, the cluster's CA (always)"),
        Row("  encryption", "", f"between datacenters: always; within one: {inside}"),
        Row("  connection bounds", "", f"{sec.max_connections_per_peer} per peer, {sec.max_connections} per listener"),
    ]
    warnings = []
    if not sec.intra_dc_encryption:
        warnings.append("security.intra_dc_encryption is off: KV blocks between replicas of one datacenter cross in plaintext (peers still authenticate)")
    if sec.bind_host is not None and ip_address(sec.bind_host).is_unspecified:
        warnings.append(f"security.bind_host is {sec.bind_host}: the data plane listens on every interface (mutual TLS still required)")
    return rows, warnings


def local_run(config: PDDConfig) -> list[Row]:
    """What `pdd run` adds on this host besides Ray's own ports (docs/design.md, Listeners)."""
    prometheus_port = urlparse(config.agents.prometheus_url).port or 9090
    admin = os.environ.get(ADMIN_HOST_VAR) or "127.0.0.1"
    return [
        Row("HAProxy stats page, exporter", f"{admin}:{HAPROXY_STATS_PORT}, :{HAPROXY_EXPORTER_PORT}", "no auth (read-only)"),
        Row("Prometheus (`pdd run`)", f"127.0.0.1:{prometheus_port}", "no auth"),
        Row("Ray dashboard (`pdd run`)", f"127.0.0.1:{DASHBOARD_PORT}", "Ray's cluster token"),
    ]


def exposure(config: PDDConfig, doc: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Exposure:
    """Every listener the config opens and how it is protected, with warnings; `doc` is the Serve
    config document (`{}` for a bare PDD config)."""
    host, port = http_address(doc)
    access, warning = api_access(config.server, host, os.environ if environ is None else environ)
    where = "- (http_options.host: null)" if host is None else f"{host}:{port}"
    found = Exposure([Row("public API", where, access)], [warning] if warning else [])
    plane, warnings = data_plane(config)
    found.rows += plane + local_run(config)
    found.warnings += warnings
    return found


def live_engines(state: Mapping[str, Any], config: PDDConfig) -> list[Row]:
    """Where the running app's engines listen (GET /pdd/state), one row per role: a token
    channel and a KV block server per replica, on ports each picks at start."""
    rows = []
    for role, r in state.get("roles", {}).items():
        replicas = r.get("replicas", [])
        nodes = ", ".join(sorted({x["node_ip"] for x in replicas})) or "-"
        rows.append(Row(f"  {role}: {len(replicas)} engine(s)", config.security.bind_host or nodes, "live"))
    return rows


def probed_api(status_without_key: int | None) -> str:
    """What the API answered a call without a key (`pdd status` makes one)."""
    if status_without_key is None:
        return "could not be reached"
    if status_without_key in (401, 403):
        return f"refuses calls without a key (HTTP {status_without_key})"
    return f"answers calls without a key (HTTP {status_without_key})"


def render(found: Exposure, title: str = "exposure") -> Group:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column()
    for item in found.rows:
        table.add_row(escape(item.what), escape(item.where), escape(item.access))
    return Group(table, *(f"[yellow]warning:[/yellow] {escape(w)}" for w in found.warnings))
