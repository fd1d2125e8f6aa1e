import pytest
from starlette.requests import Request

from pydantic import ValidationError

from app.ingress import Admission, ApiKeys, _most_telling, _param_path
from app.openai_api import APIError, ChatCompletionRequest, CompletionRequest


def _request(auth: str | None) -> Request:
    headers = [(b"authorization", auth.encode())] if auth is not None else []
    return Request({"type": "http", "headers": headers, "method": "GET", "path": "/"})


def test_no_keys_means_open(monkeypatch):
    monkeypatch.delenv("PDD_API_KEYS", raising=False)
    assert ApiKeys([]).check(_request(None)) == ""


@pytest.mark.parametrize("auth", [None, "", "Bearer", "Basic abc", "Bearer wrong"])
def test_bad_credentials_are_401(monkeypatch, auth):
    monkeypatch.delenv("PDD_API_KEYS", raising=False)
    with pytest.raises(APIError) as info:
        ApiKeys(["k1"]).check(_request(auth))
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_keys_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("PDD_API_KEYS", " k2 , k3 ,")
    keys = ApiKeys(["k1"])
    for k in ("k1", "k2", "k3"):
        assert keys.check(_request(f"Bearer {k}")) == k
    assert keys.check(_request("bearer k1")) == "k1"


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
    assert _param_path(loc) == param


def _reported(schema: type, body: dict) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        schema(model="m", **body)
    first = _most_telling([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    return _param_path(first["loc"]), first["msg"]


@pytest.mark.parametrize(
    "schema,body,param,message",
    [
        # a union reports the branch the input's type chose, not its first branch's type error
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "Field required"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
         "messages.0.content", "only text parts are supported (a text-only model), got a 'image_url' part"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")},
         "stop", "List should have at most 4 items after validation, not 5"),
        (CompletionRequest, {"prompt": [11, "x"]}, "prompt.1", "Input should be a valid integer, unable to parse string as an integer"),
        # no branch fits: the first one speaks
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "Input should be a valid string"),
    ],
)
def test_the_error_reported_is_the_one_that_says_what_is_wrong(schema, body, param, message):
    assert _reported(schema, body) == (param, message)
