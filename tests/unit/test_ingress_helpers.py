import pytest
from starlette.requests import Request

from app.ingress import Admission, ApiKeys, _param_path
from app.openai_api import APIError


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
        (("body", "prompt", "function-after[x]", 0), "prompt"),
        (("body",), None),
    ],
)
def test_param_path_drops_union_tags(loc, param):
    assert _param_path(loc) == param
