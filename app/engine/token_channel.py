"""Engine token streams: one TCP connection per (conductor replica, engine replica).

Why not Serve's handle streaming for tokens: each streamed item there is a gRPC
message plus pickling in both processes, which on a 2-core machine cost half
the throughput of vLLM's own server (measured by bench/serve_overhead.py).
Here many requests share one connection, frames are msgpack, and the frames
written in one event-loop turn leave in one syscall. Serve still deploys,
places, health-checks and discovers the replicas, and carries control calls.

Both ends authenticate with the cluster's certificates (mutual TLS,
app/engine/cluster_tls.py): a peer without one is dropped in the handshake,
before any frame is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import struct
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from app.engine.cluster_tls import PEER_NAME
from app.engine.kv.limits import ConnectionLimits

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
#: Per direction: a request carries a prompt and its sampling (a 1M-token prompt is ~5 MiB);
#: a delta may carry a long prompt's logprobs.
MAX_REQUEST_FRAME_BYTES = 16 * 1024 * 1024
MAX_DELTA_FRAME_BYTES = 64 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
#: A reader this far behind is dropped rather than buffered without bound.
MAX_WRITE_BUFFER_BYTES = 64 * 1024 * 1024


class Constraint(msgspec.Struct, omit_defaults=True):
    """A structured-output constraint, vLLM's `StructuredOutputsParams` fields: exactly one of
    json (a JSON schema, as text), regex, choice, grammar (EBNF) or json_object, and options."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class SamplingOptions(msgspec.Struct):
    """The sampling fields the API accepts, engine-side names."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """Penalises tokens of the prompt and the output alike: a continuation's earlier output, now in its prompt, counts the same."""
    min_tokens: int = 0
    """Output tokens before EOS or a stop token may end the request (a continuation gets what is left)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit: per token, so every engine applies the same."""
    logprobs: int | None = None
    """Return each output token's log probability and this many most likely alternatives (None: none)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log probability and this many most likely alternatives (None:
    none). Only the engine that computes the user's prompt can: vLLM then recomputes the whole
    prompt (it reads no cached prefix), so a continuation (`continued`) never asks."""
    constraint: Constraint | None = None
    """Structured output: each engine's grammar starts past the output other engines produced."""
    sampled_before: int = 0
    """Output tokens other engines sampled before this request's first (its prompt ends
    with them). A seeded request's generator skips their draws, penalties count them as
    output, and a constraint's grammar has accepted them (app/engine/carried_sampling.py),
    so a request that moves between engines samples what one engine would have."""

    def continued(self, done: int, max_tokens: int | None = None) -> SamplingOptions:
        """For a request whose prompt goes on with `done` more of its output tokens:
        the rest of max_tokens (or `max_tokens`), the seed's stream `done` draws on."""
        return msgspec.structs.replace(
            self,
            max_tokens=self.max_tokens - done if max_tokens is None else max_tokens,
            sampled_before=self.sampled_before + done,
            prompt_logprobs=None,
            min_tokens=max(0, self.min_tokens - done),
        )


class EngineRequest(msgspec.Struct, tag="gen"):
    """One request into one engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    """A unique salt makes the engine's prefix cache miss: naive PD has no decode-side reuse."""


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class TokenLogprob(msgspec.Struct, array_like=True):
    """One output token's log probability, and the most likely tokens at its place (best first)."""

    logprob: float
    top: list[tuple[int, float]] = []


class EngineDelta(msgspec.Struct, tag="delta"):
    """New tokens from one engine step; the last one has `finished` set."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids`, when the request asked for them."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """When the request asked for them, on the delta that ends its prefill: one per prompt
    token after the first (the first has nothing before it to be scored on)."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache or loaded by the KV connector."""
    kv_transfer_params: dict[str, Any] | None = None
    transfer: dict[str, Any] | None = None
    """The KV pull this request made, once it finished (app/engine/kv/connector.py)."""
    engine_ttft_ms: float | None = None
    """On the delta carrying the request's first token: the engine replica's time
    from handing the request to vLLM to vLLM giving that token back (its queue
    and steps, a remote KV wait, its input and output processing). What the
    request spent before and after (the conductor, Serve's routing, the token
    channel) is the serving stack's."""
    engine_core_ttft_ms: float | None = None
    """Beside `engine_ttft_ms`: the part of it inside vLLM's engine core, from the
    request joining the scheduler's queue to the step that produced the token
    (queue wait, steps, a remote KV wait; vLLM's own request metrics). The rest
    is the replica's input and output processing. None when vLLM kept no metrics."""
    engine_queued_ms: float | None = None
    """Of `engine_core_ttft_ms`, the wait in the scheduler's queue before the request's first step."""
    error: str | None = None


Frame = EngineRequest | AbortRequest | EngineDelta
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


class ChannelClosed(ConnectionError):
    """The engine replica went away mid-stream (crash, kill, network)."""


class FrameTooLarge(ConnectionError):
    pass


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> Frame:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > limit:
        raise FrameTooLarge(f"a frame of {size} bytes, over the {limit}-byte limit")
    return _decoder.decode(await reader.readexactly(size))


def _forget(tasks: dict[str, asyncio.Task], request_id: str, _done: asyncio.Task) -> None:
    tasks.pop(request_id, None)


class _FrameWriter:
    """Coalesces frames written in one loop turn into one write."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._pending: list[bytes] = []
        self._scheduled = False

    def send(self, frame: Frame) -> None:
        body = _encoder.encode(frame)
        self._pending.append(_LEN.pack(len(body)))
        self._pending.append(body)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._pending or self._writer.is_closing():
            self._pending.clear()
            return
        self._writer.write(b"".join(self._pending))
        self._pending.clear()
        if self._writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            logger.warning("token channel peer is not reading; closing the connection")
            self._writer.close()

    def close(self) -> None:
        self._flush()
        self._writer.close()


# ---- engine side -------------------------------------------------------------

DeltaSource = Callable[[EngineRequest], AsyncGenerator[EngineDelta, None]]


class TokenStreamServer:
    """Serves EngineRequests with `source`; cancelling a stream aborts its request."""

    def __init__(self, source: DeltaSource, host: str, tls: ssl.SSLContext, limits: ConnectionLimits):
        self._source = source
        self._host = host
        self._tls = tls
        self.limits = limits
        self._server: asyncio.AbstractServer | None = None
        self.port: int | None = None

    async def start(self) -> int:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve_connection, self._host, 0, ssl=self._tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            self.port = self._server.sockets[0].getsockname()[1]
        assert self.port is not None
        return self.port

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        if not self.limits.admit(peer):
            writer.transport.abort()
            return
        try:
            await self._serve_requests(reader, writer, peer)
        finally:
            self.limits.release(peer)

    async def _serve_requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        out = _FrameWriter(writer)
        tasks: dict[str, asyncio.Task] = {}
        try:
            while True:
                frame = await _read_frame(reader, MAX_REQUEST_FRAME_BYTES)
                if isinstance(frame, EngineRequest):
                    task = tasks[frame.request_id] = asyncio.create_task(self._run(frame, out))
                    task.add_done_callback(functools.partial(_forget, tasks, frame.request_id))
                elif isinstance(frame, AbortRequest):
                    running = tasks.pop(frame.request_id, None)
                    if running is not None:
                        running.cancel()
        except FrameTooLarge as exc:
            logger.warning("token channel: closing the connection from %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        finally:
            for task in list(tasks.values()):
                task.cancel()
            out.close()

    async def _run(self, frame: EngineRequest, out: _FrameWriter) -> None:
        try:
            async for delta in self._source(frame):
                out.send(delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the conductor in-band
            logger.exception("request %s failed in the engine", frame.request_id)
            error = f"{type(exc).__name__}: {exc}"
            out.send(EngineDelta(request_id=frame.request_id, token_ids=[], finished=True, finish_reason="error", error=error))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


# ---- conductor side ----------------------------------------------------------


class TokenStreamClient:
    """One connection to one engine replica, shared by all of its requests."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext, connect_timeout_s: float = 5.0):
        self.address = (host, port)
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._writer: _FrameWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._connecting: asyncio.Lock | None = None
        self.closed = False

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def _ensure_connected(self) -> _FrameWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.closed:
                raise ChannelClosed(f"engine at {self.address[0]}:{self.address[1]} is gone")
            if self._writer is None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(*self.address, ssl=self._tls, server_hostname=PEER_NAME), self._connect_timeout_s
                    )
                except (TimeoutError, OSError) as exc:
                    self.closed = True
                    raise ChannelClosed(f"cannot reach engine at {self.address[0]}:{self.address[1]}: {exc}") from exc
                self._writer = _FrameWriter(writer)
                self._reader_task = asyncio.create_task(self._read_loop(reader))
            return self._writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await _read_frame(reader, MAX_DELTA_FRAME_BYTES)
                if isinstance(frame, EngineDelta):
                    queue = self._streams.get(frame.request_id)
                    if queue is not None:
                        queue.put_nowait(frame)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        finally:
            self.closed = True
            for queue in self._streams.values():
                queue.put_nowait(None)

    async def stream(self, request: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Deltas of one request until the finished one; leaving early aborts it."""
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid} is already streaming on this engine")
        writer = await self._ensure_connected()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        finished = False
        try:
            writer.send(request)
            while True:
                delta = queue.get_nowait() if not queue.empty() else await queue.get()
                if delta is None:
                    raise ChannelClosed(f"engine at {self.address[0]}:{self.address[1]} closed the stream")
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self.closed:
                writer.send(AbortRequest(request_id=rid))

    async def close(self) -> None:
        self.closed = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
