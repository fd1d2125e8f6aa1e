"""Moving KV blocks: the prefill side's block server and the decoding side's pull.

Runs inside vLLM's worker process (threads and blocking sockets: there is no
event loop there). A pull names a lease and the block indices it wants; the
server answers with a header describing the block layout and then the raw
bytes, block by block, layer by layer. Both sides must hold the same model,
dtype and block size: the layout is checked, never assumed.

Every connection is mutual TLS with the cluster's certificates
(app/engine/cluster_tls.py), end to end: a link relay in between forwards the
encrypted bytes. With `security.intra_dc_encryption` off, a pull inside one
datacenter still authenticates and sends its request over TLS, then both ends
close TLS (close_notify) and the blocks follow in plaintext. A lease id is a
capability (app/engine/kv/leases.py), not the request id clients see.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from app.engine.cluster_tls import PEER_NAME
from app.engine.kv.leases import FRESH_S, Lease, LeaseIds, LeaseTable
from app.engine.kv.limits import ConnectionLimits

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 16 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0


class PullRequest(msgspec.Struct):
    lease_id: str
    indices: list[int]
    """Positions in the lease's block list to send, in order."""
    puller: str
    """Who pulls (request id on the decoding side), for logs."""
    plaintext: bool = False
    """After this request and the header, send the blocks outside TLS (an intra-datacenter
    pull with `security.intra_dc_encryption` off); a server that encrypts every pull refuses."""


class PullHeader(msgspec.Struct):
    ok: bool
    error: str | None = None
    layout: list[tuple[str, list[int], str]] = []
    """Per layer (sorted by name): name, shape of one block, dtype."""
    block_nbytes: int = 0
    count: int = 0
    lease_gone: bool = False
    """Refused because the source no longer holds the lease (expired, or every consumer pulled)."""


class LeaseGone(Exception):
    """The source no longer holds the lease: it expired (the pull waited past
    `kv.lease_timeout_s`, e.g. queued behind a full link) or its consumers are done.
    Not a link failure: the link may be healthy and merely full."""


def _send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def _recv_msg(sock: socket.socket, typ: type[msgspec.Struct]):
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_HEADER_BYTES:
        raise ConnectionError(f"header of {size} bytes exceeds the limit")
    return msgspec.msgpack.decode(_recv_exact(sock, size), type=typ)


@dataclass
class KVLayout:
    """How one engine's paged KV cache is laid out, per layer."""

    tensors: dict[str, torch.Tensor]
    block_dims: dict[str, int]

    @classmethod
    def from_caches(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
        dims = {}
        for name, t in kv_caches.items():
            dim = next((d for d, size in enumerate(t.shape) if size == num_blocks), None)
            if dim is None:
                raise ValueError(f"cannot find the block dimension of {name} {tuple(t.shape)} ({num_blocks} blocks)")
            dims[name] = dim
        return cls(dict(sorted(kv_caches.items())), dims)

    def describe(self) -> list[tuple[str, list[int], str]]:
        out = []
        for name, t in self.tensors.items():
            shape = list(t.shape)
            del shape[self.block_dims[name]]
            out.append((name, shape, str(t.dtype).removeprefix("torch.")))
        return out

    @property
    def block_nbytes(self) -> int:
        return sum(t.select(self.block_dims[n], 0).numel() * t.element_size() for n, t in self.tensors.items())

    def block_bytes(self, block_id: int) -> list[memoryview]:
        views = []
        for name, t in self.tensors.items():
            part = t.select(self.block_dims[name], block_id)
            if not part.is_contiguous() or part.device.type != "cpu":
                part = part.contiguous().cpu()
            views.append(part.view(torch.uint8).numpy().data.cast("B"))
        return views

    def write_block(self, block_id: int, data: memoryview) -> None:
        offset = 0
        for name, t in self.tensors.items():
            dst = t.select(self.block_dims[name], block_id)
            n = dst.numel() * t.element_size()
            src = torch.frombuffer(data[offset : offset + n], dtype=torch.uint8).view(t.dtype).view(dst.shape)
            dst.copy_(src)
            offset += n


# ---- prefill side ---------------------------------------------------------------


class BlockServer:
    """Serves leased blocks to pulling decoders (a thread per connection, their number bounded)."""

    def __init__(
        self,
        layout_fn: Callable[[], KVLayout | None],
        leases: LeaseTable,
        ids: LeaseIds,
        address: tuple[str, int],
        tls: ssl.SSLContext,
        limits: ConnectionLimits,
        allow_plaintext: bool = False,
        lease_wait_s: float = 2.0,
    ):
        self._layout_fn = layout_fn
        self.leases = leases
        self._ids = ids
        self._tls = tls
        self.limits = limits
        self._allow_plaintext = allow_plaintext
        self._lease_wait_s = lease_wait_s
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request)

        class Listener(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

            def verify_request(self, request: Any, client_address: Any) -> bool:
                return limits.admit(client_address[0])  # refused: closed at once, no thread started

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    limits.release(client_address[0])

        self._tcp = Listener(address, Handler)
        self.port = self._tcp.server_address[1]
        self._thread = threading.Thread(target=self._tcp.serve_forever, name="pdd-kv-block-server", daemon=True)
        self._thread.start()

    def _handle(self, raw: socket.socket) -> None:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.settimeout(HANDSHAKE_TIMEOUT_S)
        try:  # a peer without the cluster's certificate is dropped here, before any request is read
            sock = self._tls.wrap_socket(raw, server_side=True)
        except OSError:  # ssl.SSLError included
            return
        with sock:
            try:
                req = _recv_msg(sock, PullRequest)
            except (ConnectionError, OSError, msgspec.DecodeError):
                return
            sock.settimeout(None)
            self._serve(sock, req)

    def _lease(self, req: PullRequest) -> Lease | PullHeader:
        """The lease being served to this pull, or the refusal to send."""
        if self._layout_fn() is None:
            return PullHeader(ok=False, error="KV caches not registered")
        if req.plaintext and not self._allow_plaintext:
            return PullHeader(ok=False, error="this block server encrypts every pull (security.intra_dc_encryption is on)")
        age = self._ids.age_s(req.lease_id)
        if age is None:
            return PullHeader(ok=False, error="no such lease (not one this block server issued)", lease_gone=True)
        lease = self.leases.begin(req.lease_id, self._lease_wait_s if age < FRESH_S else 0.0)
        if lease is None:
            return PullHeader(ok=False, error="no such lease (expired, already pulled, or never issued)", lease_gone=True)
        return lease

    def _serve(self, sock: ssl.SSLSocket, req: PullRequest) -> None:
        lease = self._lease(req)
        if isinstance(lease, PullHeader):
            with contextlib.suppress(OSError):
                _send_msg(sock, lease)
            return
        try:
            layout = self._layout_fn()
            assert layout is not None
            bad = [i for i in req.indices if not 0 <= i < len(lease.block_ids)]
            if bad:
                _send_msg(sock, PullHeader(ok=False, error=f"block indices {bad[:5]} outside the lease's {len(lease.block_ids)} blocks"))
                return
            _send_msg(sock, PullHeader(ok=True, layout=layout.describe(), block_nbytes=layout.block_nbytes, count=len(req.indices)))
            out: socket.socket = sock
            if req.plaintext:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)  # the puller's close_notify
                out = sock.unwrap()
                out.settimeout(None)
            for i in req.indices:
                for view in layout.block_bytes(lease.block_ids[i]):
                    out.sendall(view)
        except (ConnectionError, OSError) as exc:
            logger.info("pull by %s broke off: %s", req.puller, exc)
        finally:
            self.leases.pulled(req.lease_id)

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()


# ---- decoding side --------------------------------------------------------------


@dataclass
class PullSpec:
    """One decoder request's pull, as the scheduler side planned it."""

    request_id: str
    lease_id: str
    source: tuple[str, int]
    """The prefill replica's block server."""
    relay: tuple[str, int] | None
    """The link relay to go through (None: connect directly)."""
    link: str
    remote_indices: list[int]
    local_block_ids: list[int]
    """Where each pulled block goes in this engine's cache."""
    plaintext: bool = False
    """Receive the blocks outside TLS (`PullRequest.plaintext`)."""


@dataclass
class PullResult:
    request_id: str
    link: str
    requested_blocks: int = 0
    """0 for a pull that only releases the consumer's share of a lease."""
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    queued_seconds: float = 0.0
    """From the pull's submission to a free pull thread."""
    ok: bool = True
    error: str | None = None
    failed_block_ids: list[int] = field(default_factory=list)


def pull_blocks(
    spec: PullSpec, layout: KVLayout, tls: ssl.SSLContext, connect_timeout_s: float, transfer_timeout_s: float, submitted_at: float | None = None
) -> PullResult:
    """Fetch the blocks into this engine's cache; failures are reported, never raised.
    `submitted_at` (time.monotonic()): when the pull was handed to the pull threads."""
    result = PullResult(spec.request_id, spec.link, requested_blocks=len(spec.remote_indices))
    t0 = time.monotonic()
    if submitted_at is not None:
        result.queued_seconds = max(0.0, t0 - submitted_at)
    written: set[int] = set()
    try:
        raw = socket.create_connection(spec.relay or spec.source, timeout=connect_timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if spec.relay is not None:  # the relay's preamble, then TLS through it to the source
            raw.sendall(f"{spec.source[0]}:{spec.source[1]}\n".encode())
        raw.settimeout(transfer_timeout_s)
        with tls.wrap_socket(raw, server_hostname=PEER_NAME) as sock:
            _send_msg(sock, PullRequest(spec.lease_id, spec.remote_indices, spec.request_id, spec.plaintext))
            header = _recv_msg(sock, PullHeader)
            if not header.ok:
                raise (LeaseGone if header.lease_gone else ConnectionError)(header.error or "refused")
            mine = layout.describe()
            if [list(x) for x in header.layout] != [list(x) for x in mine]:
                raise ValueError(f"KV layout differs: source {header.layout[:1]}..., here {mine[:1]}...")
            blocks_from: socket.socket = sock.unwrap() if spec.plaintext else sock
            buf = memoryview(bytearray(header.block_nbytes))
            deadline = t0 + transfer_timeout_s
            for local in spec.local_block_ids:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer exceeded {transfer_timeout_s:.0f} s")
                _recv_exact(blocks_from, header.block_nbytes, buf)
                result.bytes += header.block_nbytes
                result.blocks += 1
                layout.write_block(local, buf)
                written.add(local)
    except (OSError, ConnectionError, LeaseGone, ValueError, TimeoutError, msgspec.DecodeError) as exc:
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"
        result.failed_block_ids = [b for b in spec.local_block_ids if b not in written]
    result.seconds = time.monotonic() - t0
    return result


def release_lease(source: tuple[str, int], lease_id: str, tls: ssl.SSLContext, timeout_s: float = 5.0) -> bool:
    """Give up one consumer's share of a lease without pulling (nothing left to decode)."""
    try:
        raw = socket.create_connection(source, timeout=timeout_s)
        with tls.wrap_socket(raw, server_hostname=PEER_NAME) as sock:
            _send_msg(sock, PullRequest(lease_id, [], "release"))
            return _recv_msg(sock, PullHeader).ok
    except (OSError, ConnectionError, msgspec.DecodeError):
        return False
