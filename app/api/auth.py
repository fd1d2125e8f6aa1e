"""Who may call the public API: bearer keys of two scopes, and the key generated when none is configured.

- inference keys (`server.api_keys`, PDD_API_KEYS): /v1/*, and the journeys of their own requests;
- operator keys (`server.operator_api_keys`, PDD_OPERATOR_API_KEYS): all of that, every
  user's journeys, /pdd/state and /pdd/chat.

With no key configured the API is open while Serve binds loopback only (local runs, tests).
Bound beyond it (`http_options.host: 0.0.0.0`), the ingress accepts only the cluster's
generated operator key, unless `server.allow_anonymous` says to stay open. That key is made
once per Ray cluster and kept in Ray's GCS (put-if-absent, so every ingress replica agrees,
as app/engine/cluster_tls.py keeps the data plane's CA); the replica that makes it writes it
to a file only its user reads (`key_file()`) and logs that path, never the key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from fastapi import Request

from app.api.openai_requests import APIError
from app.config import ServerConfig
from app.ray_private import kv_get, kv_put

logger = logging.getLogger(__name__)

GCS_KEY, GCS_NAMESPACE = "api_key", "pdd"
KEY_FILE_ENV = "PDD_API_KEY_FILE"
"""Where the generated key is written; default ~/.config/pdd-serve/api-key."""


class Scope(StrEnum):
    inference = "inference"
    operator = "operator"


def fingerprint(key: str) -> str:
    """What a journey records of the key that made it: a hash, never the key ("" without auth)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


@dataclass(frozen=True)
class Caller:
    key: str
    """The bearer key ("" when auth is off)."""
    scope: Scope

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def listed_owner(self) -> str | None:
        """Whose journeys this caller reads: its own key's (a fingerprint), or None: everyone's
        (an operator; every caller while auth is off)."""
        return None if self.scope is Scope.operator else self.fingerprint

    def may_read(self, owner: str) -> bool:
        """Whether this caller may read a journey recorded with `owner` (a fingerprint)."""
        return self.listed_owner in (None, owner)


def _env_keys(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


class ApiKeys:
    """The keys of each scope; none at all: open (every caller is an anonymous operator)."""

    def __init__(self, inference: list[str] | None = None, operator: list[str] | None = None):
        self._operator = frozenset(operator or [])
        self._inference = frozenset(inference or []) - self._operator

    @classmethod
    def configured(cls, server: ServerConfig) -> ApiKeys:
        """The config's keys plus PDD_API_KEYS and PDD_OPERATOR_API_KEYS (comma-separated)."""
        return cls(server.api_keys + _env_keys("PDD_API_KEYS"), server.operator_api_keys + _env_keys("PDD_OPERATOR_API_KEYS"))

    @property
    def open(self) -> bool:
        return not (self._inference or self._operator)

    def caller(self, request: Request) -> Caller:
        """Who calls, with a key of either scope; 401 without a valid one."""
        if self.open:
            return Caller("", Scope.operator)
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if key in self._operator:
            return Caller(key, Scope.operator)
        if key in self._inference:
            return Caller(key, Scope.inference)
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    def operator(self, request: Request) -> Caller:
        """A caller with an operator key; 403 for an inference key."""
        caller = self.caller(request)
        if caller.scope is not Scope.operator:
            raise APIError(403, "This endpoint needs an operator key (server.operator_api_keys)", type="permission_error", code="insufficient_scope")
        return caller


def is_loopback(host: str | None) -> bool:
    """Whether Serve binding `host` serves this machine only (None: Serve runs no HTTP proxy)."""
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def api_keys(server: ServerConfig, bind_host: str | None) -> ApiKeys:
    """The keys an ingress accepts when Serve binds `bind_host` (the module's docstring says which)."""
    keys = ApiKeys.configured(server)
    if not keys.open or is_loopback(bind_host):
        return keys
    if server.allow_anonymous:
        logger.warning("the API binds %s with no API key (server.allow_anonymous): anyone who reaches it may call every endpoint", bind_host)
        return keys
    generated = cluster_api_key()
    logger.warning(
        "the API binds %s and no key is configured: it accepts the cluster's generated operator key only, stored in %s "
        "(set server.api_keys / server.operator_api_keys, or server.allow_anonymous)",
        bind_host,
        generated["stored_in"],
    )
    return ApiKeys(operator=[generated["key"]])


def key_file() -> Path:
    return Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".config" / "pdd-serve" / "api-key")


def cluster_api_key() -> dict[str, str]:
    """{"key", "stored_in"}: this Ray cluster's generated operator key, made on first use."""
    stored = kv_get(GCS_KEY, GCS_NAMESPACE)
    if stored is None:
        path = key_file()
        made = {"key": f"pdd-{secrets.token_urlsafe(32)}", "stored_in": f"{path} on {socket.gethostname()}, and Ray's GCS (pdd/{GCS_KEY})"}
        if not kv_put(GCS_KEY, json.dumps(made).encode(), GCS_NAMESPACE, overwrite=False):  # this replica's key won
            _write_private(path, made["key"])
            logger.warning("API key generated, stored in %s", made["stored_in"])
        stored = kv_get(GCS_KEY, GCS_NAMESPACE)
        assert stored is not None
    return json.loads(stored)


def _write_private(path: Path, text: str) -> None:
    """`text` in a file only this user reads (0600, in a 0700 folder when it makes one)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
    except OSError as err:
        logger.error("cannot write the generated API key to %s (%s); read it from Ray's GCS: pdd/%s", path, err, GCS_KEY)


def local_key() -> str | None:
    """A key for this machine's own clients (`pdd run`, `pdd ask`): PDD_API_KEY, else the
    generated key's file when this user can read it."""
    if key := os.environ.get("PDD_API_KEY"):
        return key
    try:
        return key_file().read_text().strip() or None
    except OSError:
        return None
