"""Helpers for the responses that merge several engine streams (n choices, batched prompts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from app.conductor.generation import Output

T = TypeVar("T")


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def all_of(coros: list[Awaitable[T]]) -> list[T]:
    """Every result in order; the first failure cancels the others and is raised as itself."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """(index, item) from every stream as each item comes; the first failure stops the others
    and is raised as itself."""
    if len(streams) == 1:  # the common case, without a task per item
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item, end = await queue.get()
            if end is _DONE:
                running -= 1
            elif end is not None:
                raise end
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


_DONE = object()


async def prompt_only(outputs: AsyncGenerator[Output, None]) -> AsyncGenerator[Output, None]:
    """An echoed prompt that is not continued (max_tokens 0): the prompt's log probabilities
    and a `length` finish, without the engines' one token."""
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.prompt_logprobs is not None:
                yield Output("", 0, prompt_logprobs=out.prompt_logprobs)
    yield Output("", 0, finish_reason="length")
