"""The public API's keys (app/api/auth.py): two scopes, the key generated when the API binds
beyond loopback, and each key's journeys; the scope checks through the ingress's real routes."""

from __future__ import annotations

import json
import logging
import stat

import pytest
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from starlette.requests import Request
from transformers import AutoTokenizer

from app.api import auth
from app.api.admission import Admission
from app.api.auth import ApiKeys, Scope, api_keys, cluster_api_key, fingerprint, is_loopback
from app.api.ingress import ConductorIngress, api
from app.api.openai_requests import APIError
from app.conductor.conductor import Conductor
from app.config import PDDConfig, ServerConfig
from app.engine.devmodel import ensure_devmodel
from tests.conftest import local_args
from tests.unit.test_conductor import SENTENCE, ScriptedEngines

INFERENCE, OPERATOR = "inf-key", "op-key"


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch, tmp_path):
    for name in ("PDD_API_KEYS", "PDD_OPERATOR_API_KEYS", "PDD_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(tmp_path / "pdd" / "api-key"))


@pytest.fixture
def gcs(monkeypatch) -> dict[str, bytes]:
    """Ray's GCS key-value store, as a dict with its put-if-absent semantics."""
    store: dict[str, bytes] = {}

    def put(key: str, value: bytes, namespace: str, *, overwrite: bool = True) -> bool:
        existed = f"{namespace}/{key}" in store
        if overwrite or not existed:
            store[f"{namespace}/{key}"] = value
        return existed

    monkeypatch.setattr(auth, "kv_get", lambda key, namespace: store.get(f"{namespace}/{key}"))
    monkeypatch.setattr(auth, "kv_put", put)
    return store


def _request(auth_header: str | None) -> Request:
    headers = [(b"authorization", auth_header.encode())] if auth_header is not None else []
    return Request({"type": "http", "headers": headers, "method": "GET", "path": "/"})


def test_no_keys_means_open():
    caller = ApiKeys().caller(_request(None))
    assert (caller.key, caller.scope, caller.listed_owner) == ("", Scope.operator, None)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", "Bearer wrong"])
def test_bad_credentials_are_401(header):
    with pytest.raises(APIError) as info:
        ApiKeys(["k1"]).caller(_request(header))
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_keys_from_config_and_environment(monkeypatch):
    monkeypatch.setenv("PDD_API_KEYS", " k2 , k3 ,")
    monkeypatch.setenv("PDD_OPERATOR_API_KEYS", "o2")
    keys = ApiKeys.configured(ServerConfig(api_keys=["k1"], operator_api_keys=["o1"]))
    for k in ("k1", "k2", "k3"):
        assert keys.caller(_request(f"Bearer {k}")).scope is Scope.inference
    assert keys.caller(_request("bearer k1")).key == "k1"
    for k in ("o1", "o2"):
        assert keys.operator(_request(f"Bearer {k}")).scope is Scope.operator
    with pytest.raises(APIError) as info:
        keys.operator(_request("Bearer k1"))
    assert (info.value.status, info.value.type) == (403, "permission_error")


def test_a_key_in_both_lists_is_an_operator_key():
    assert ApiKeys(["k"], ["k"]).operator(_request("Bearer k")).scope is Scope.operator


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), (None, True), ("0.0.0.0", False), ("10.0.0.7", False), ("::", False), ("pdd.example", False)],
)
def test_which_binds_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_loopback_without_keys_stays_open(gcs):
    assert api_keys(ServerConfig(), "127.0.0.1").open and not gcs


def test_configured_keys_are_used_whatever_the_bind(gcs):
    keys = api_keys(ServerConfig(api_keys=[INFERENCE]), "0.0.0.0")
    assert keys.caller(_request(f"Bearer {INFERENCE}")).scope is Scope.inference and not gcs


def test_beyond_loopback_without_keys_a_generated_operator_key_is_the_only_one(gcs, caplog):
    with caplog.at_level(logging.WARNING, logger="app.api.auth"):
        keys = api_keys(ServerConfig(), "0.0.0.0")
    key = auth.key_file().read_text().strip()
    assert key.startswith("pdd-") and len(key) > 40
    assert keys.operator(_request(f"Bearer {key}")).key == key
    with pytest.raises(APIError) as info:
        keys.caller(_request(None))
    assert info.value.status == 401
    # the file is the user's alone; the logs say where it is, never what it is
    assert stat.S_IMODE(auth.key_file().stat().st_mode) == 0o600
    assert stat.S_IMODE(auth.key_file().parent.stat().st_mode) == 0o700
    assert f"API key generated, stored in {auth.key_file()}" in caplog.text and key not in caplog.text
    assert json.loads(gcs["pdd/api_key"])["key"] == key


def test_every_replica_agrees_on_one_generated_key_and_only_its_maker_writes_the_file(gcs):
    first = cluster_api_key()
    auth.key_file().unlink()
    assert cluster_api_key() == first and not auth.key_file().exists()  # read from the GCS


def test_a_replica_that_loses_the_race_to_put_its_key_uses_the_winners(gcs, monkeypatch):
    gets = iter([None, json.dumps({"key": "winner", "stored_in": "elsewhere"}).encode()])
    monkeypatch.setattr(auth, "kv_get", lambda key, namespace: next(gets))
    monkeypatch.setattr(auth, "kv_put", lambda *args, **kwargs: True)  # someone put first
    assert cluster_api_key()["key"] == "winner" and not auth.key_file().exists()


def test_a_key_file_left_readable_by_others_is_made_private(gcs):
    path = auth.key_file()
    path.parent.mkdir(parents=True)
    path.write_text("old")
    path.chmod(0o644)
    cluster_api_key()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() != "old"


def test_allow_anonymous_keeps_the_api_open_with_a_warning(gcs, caplog):
    with caplog.at_level(logging.WARNING, logger="app.api.auth"):
        assert api_keys(ServerConfig(allow_anonymous=True), "0.0.0.0").open
    assert "server.allow_anonymous" in caplog.text and not gcs


def test_local_clients_use_pdd_api_key_else_the_generated_file(gcs, monkeypatch):
    assert auth.local_key() is None
    generated = cluster_api_key()["key"]
    assert auth.local_key() == generated
    monkeypatch.setenv("PDD_API_KEY", "mine")
    assert auth.local_key() == "mine"


# ---- the ingress's own routes, on scripted engines ---------------------------------------


class FakeChatOps:
    async def respond(self, body, key: str) -> StreamingResponse:
        return StreamingResponse(iter([b"data: ok\n\n"]), media_type="text/event-stream")


# Serve's ASGI wrapper shuts its app down in an async __del__, which an object it never started need not do
_Ingress = type("_Ingress", (ConductorIngress.func_or_class,), {"__del__": lambda self: None})


def _ingress(keys: ApiKeys):
    """A ConductorIngress as its __init__ builds one, on a conductor of scripted engines (no Serve, no vLLM)."""
    args = local_args()
    args["mode"] = "colocated"
    config = PDDConfig.model_validate(args)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_devmodel()))
    engines = ScriptedEngines(tokenizer.backend_tokenizer.encode(SENTENCE, add_special_tokens=False).ids)
    ingress = object.__new__(_Ingress)
    ingress.config, ingress.tokenizer, ingress.keys, ingress.chat_ops, ingress.created = config, tokenizer, keys, FakeChatOps(), 0
    ingress._anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
    ingress._anchor_text, ingress._token_texts = tokenizer.decode([ingress._anchor]), {}
    ingress.conductor = Conductor(config, engines, links=None, tokenizer=tokenizer.backend_tokenizer)
    ingress.admission = Admission(config.server.max_concurrent_per_key, config.server.max_queued_requests)

    async def state():
        return {"mode": "colocated"}

    ingress.conductor.state = state
    return ingress


@pytest.fixture
def serve_with():
    """A TestClient of the real FastAPI app whose routes' `self` (Serve's lookup of the replica's
    object, which every class-based route depends on) is an ingress with the given keys."""
    servable = next(d.call for route in api.routes if hasattr(route, "dependant") for d in route.dependant.dependencies if d.name == "self")
    clients = []

    def serve(keys: ApiKeys) -> TestClient:
        ingress = _ingress(keys)
        api.dependency_overrides[servable] = lambda: ingress
        clients.append(TestClient(api).__enter__())
        return clients[-1]

    yield serve
    for c in clients:
        c.__exit__(None, None, None)
    api.dependency_overrides.clear()


@pytest.fixture
def client(serve_with):
    return serve_with(ApiKeys([INFERENCE, "other-inf"], [OPERATOR]))


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _complete(client: TestClient, key: str) -> str:
    resp = client.post("/v1/completions", headers=_bearer(key), json={"model": "pdd-dev", "prompt": [11, 12, 13], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def test_inference_keys_call_v1_and_not_the_operator_endpoints(client):
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers=_bearer("nope")).json()["error"]["code"] == "invalid_api_key"
    for key in (INFERENCE, OPERATOR):
        assert client.get("/v1/models", headers=_bearer(key)).status_code == 200
    for method, path, body in (("GET", "/pdd/state", None), ("POST", "/pdd/chat", {"message": "how are we doing?"})):
        refused = client.request(method, path, headers=_bearer(INFERENCE), json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope", refused.text
        assert client.request(method, path, headers=_bearer(OPERATOR), json=body).status_code == 200
        assert client.request(method, path, json=body).status_code == 401
    assert client.get("/health").status_code == 200


def test_a_journey_is_readable_by_its_own_key_and_operators_only(client):
    mine, theirs = _complete(client, INFERENCE), _complete(client, "other-inf")
    own = client.get(f"/pdd/requests/{mine}", headers=_bearer(INFERENCE))
    assert own.status_code == 200 and own.json()["key_fingerprint"] == fingerprint(INFERENCE)
    assert INFERENCE not in own.text
    hidden = client.get(f"/pdd/requests/{theirs}", headers=_bearer(INFERENCE))
    assert hidden.status_code == 404 and hidden.json()["error"]["type"] == "not_found_error"
    listed = client.get("/pdd/requests", headers=_bearer(INFERENCE)).json()["requests"]
    assert [j["request_id"] for j in listed] == [mine]
    everyone = client.get("/pdd/requests", headers=_bearer(OPERATOR)).json()["requests"]
    assert [j["request_id"] for j in everyone] == [mine, theirs]
    assert client.get(f"/pdd/requests/{theirs}", headers=_bearer(OPERATOR)).status_code == 200


def test_without_keys_everything_stays_open(serve_with):
    client = serve_with(ApiKeys())
    request_id = _complete(client, "anything")
    assert client.get("/pdd/state").status_code == 200
    assert [j["request_id"] for j in client.get("/pdd/requests").json()["requests"]] == [request_id]
    assert client.get(f"/pdd/requests/{request_id}").json()["key_fingerprint"] == ""


def test_pdd_run_tries_its_app_with_a_configured_key_else_the_generated_one(gcs, monkeypatch):
    from app.ops.cli import _api_headers

    config = PDDConfig.model_validate(local_args())
    assert _api_headers(config) == {}
    generated = cluster_api_key()["key"]
    assert _api_headers(config) == _bearer(generated)
    monkeypatch.setenv("PDD_API_KEYS", "from-env")
    assert _api_headers(config) == _bearer("from-env")
    monkeypatch.setenv("PDD_API_KEY", "mine")
    assert _api_headers(config) == _bearer("mine")
