import asyncio

import pytest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from app.api.admission import Admission, SeatedStream
from app.api.errors import most_telling, param_path
from app.api.openai_requests import APIError, ChatCompletionRequest, CompletionRequest
from app.api.streams import all_of, merge_streams


def test_admission_bounds_per_key_and_total():
    adm = Admission(per_key=2, total=3)
    adm.enter("a")
    adm.enter("a")
    with pytest.raises(APIError) as info:
        adm.enter("a")
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    adm.enter("b")
    with pytest.raises(APIError) as info:
        adm.enter("c")
    assert info.value.code == "server_busy"
    adm.leave("a")
    adm.enter("c")
    assert adm.in_flight == 3


@pytest.mark.parametrize(
    "loc,param",
    [
        (("body", "temperature"), "temperature"),
        (("body", "stop", "list[str]"), "stop"),
        (("body", "messages", 0, "role"), "messages.0.role"),
        (("body", "prompt", "function-after[x]", 0), "prompt.0"),
        (("body", "messages", 0, "content", "list[TextContentPart]", 0, "text"), "messages.0.content.0.text"),
        (("body",), None),
        (("query", "limit"), "limit"),
    ],
)
def test_param_path_drops_union_tags(loc, param):
    assert param_path(loc) == param


def _reported(schema: type, body: dict) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        schema(model="m", **body)
    first = most_telling([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    return param_path(first["loc"]), first["msg"]


@pytest.mark.parametrize(
    "schema,body,param,message",
    [
        # a union reports the branch the input's type chose, not its first branch's type error
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "Field required"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "messages.0.content",
            "only text parts are supported (a text-only model), got a 'image_url' part",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")},
            "stop",
            "List should have at most 4 items after validation, not 5",
        ),
        (CompletionRequest, {"prompt": [11, "x"]}, "prompt.1", "Input should be a valid integer, unable to parse string as an integer"),
        # no branch fits: the first one speaks
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "Input should be a valid string"),
    ],
)
def test_the_error_reported_is_the_one_that_says_what_is_wrong(schema, body, param, message):
    assert _reported(schema, body) == (param, message)


def test_seats_are_taken_all_or_none_and_given_back_once():
    adm = Admission(per_key=4, total=5)
    seats = adm.seats("a", 3)
    with pytest.raises(APIError) as info:
        adm.seats("a", 2)  # the key has 1 place left: none is taken
    assert info.value.status == 429 and adm.in_flight == 3
    adm.seats("b", 2)
    seats.release()
    seats.release()  # the stream's end and the response's end both give back; once counts
    assert adm.in_flight == 2


async def test_a_stream_whose_client_left_before_it_started_gives_its_seats_back():
    adm = Admission(per_key=4, total=4)
    started = []

    async def body():
        started.append(True)
        yield b"data: x\n\n"

    async def gone(message):
        raise OSError("connection reset")  # the client left before the response started

    with pytest.raises(ClientDisconnect):
        await SeatedStream(body(), adm.seats("a", 2))({"type": "http", "asgi": {"spec_version": "2.4"}}, None, gone)
    assert not started and adm.in_flight == 0


async def _items(name: str, delays: list[float], fail_at: int | None = None, ended: list | None = None):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise ValueError(f"{name} broke")
            yield f"{name}{i}"
    finally:
        if ended is not None:
            ended.append(name)


async def test_merged_streams_interleave_by_arrival_and_keep_their_index():
    got = [x async for x in merge_streams([_items("a", [0.0, 0.2]), _items("b", [0.02, 0.0, 0.0])])]
    assert got == [(0, "a0"), (1, "b0"), (1, "b1"), (1, "b2"), (0, "a1")]


async def test_a_failing_stream_fails_the_merge_and_closes_the_others():
    ended: list[str] = []
    merged = merge_streams([_items("a", [0.0, 10.0], ended=ended), _items("b", [0.01], fail_at=0, ended=ended)])
    with pytest.raises(ValueError, match="b broke"):
        async for _ in merged:
            pass
    await asyncio.sleep(0)
    assert sorted(ended) == ["a", "b"]


async def test_leaving_a_merge_early_closes_every_stream():
    ended: list[str] = []
    merged = merge_streams([_items("a", [0.0, 10.0], ended=ended), _items("b", [0.0, 10.0], ended=ended)])
    assert (await anext(merged))[1] in ("a0", "b0")
    await merged.aclose()
    await asyncio.sleep(0)
    assert sorted(ended) == ["a", "b"]


async def test_all_keeps_order_and_a_failure_cancels_the_rest():
    async def after(delay: float, value):
        await asyncio.sleep(delay)
        if isinstance(value, Exception):
            raise value
        return value

    assert await all_of([after(0.02, 1), after(0.0, 2)]) == [1, 2]
    slow = asyncio.ensure_future(after(10.0, 3))
    with pytest.raises(KeyError):
        await all_of([slow, after(0.0, KeyError("x"))])
    await asyncio.sleep(0)
    assert slow.cancelled()
