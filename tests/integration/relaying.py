"""Helpers for tests that need a request to cross P, RLD and MD on the one emulated WAN."""

from __future__ import annotations

import random
import time
from pprint import pformat

import openai

from app.ops.faults import Faults

WAN = "dc-a->dc-b"

_seed = iter(range(10_000))


WAN_HOLD_S = 60
"""Longest a `relayed_while_wan_held` request holds MD's pull: under kv.transfer_timeout_s (120 s)."""


def relayed_while_wan_held(app, prompt, max_tokens: int, relayed_pieces: int = 1, **params) -> tuple[str, dict]:
    """A streamed completion (greedy unless `params` say otherwise) whose WAN stalls until
    RLD's tokens reach the client.

    MD takes over when its pull ends; the stall holds that pull until the stream's
    `relayed_pieces` pieces of text after P's (P sends one token), or at most WAN_HOLD_S.
    However slow the machine is to start RLD, MD cannot take over before RLD's first token."""
    faults = Faults(app.name)
    faults.stall_link(WAN, WAN_HOLD_S)
    text, pieces, request_id = "", 0, None
    try:
        for chunk in api(app).completions.create(model="pdd-dev", prompt=prompt, max_tokens=max_tokens, stream=True, **{"temperature": 0, **params}):
            request_id = chunk.id
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                pieces += 1
                if pieces == 1 + relayed_pieces:
                    faults.restore_link(WAN)
    finally:
        faults.restore_link(WAN)
    return text, app.journey(request_id)


def api(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.v1, api_key="none", max_retries=0, timeout=300)


def fresh(n: int) -> list[int]:
    """A prompt no engine has seen."""
    rng = random.Random(1000 + next(_seed))
    return [rng.randrange(10, 500) for _ in range(n)]


def wait_wan_idle(app, quiet_s: float = 1.0, timeout_s: float = 60) -> None:
    """Until no KV bytes crossed the WAN for `quiet_s` (background MD warm-ups done) and routing's
    model of the WAN holds no backlog either (model and link drain on their own clocks: the next
    turn's estimate counts what the model still holds)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        wan = app.state()["links"][WAN]  # the link's counters and routing's backlog, in one read
        if wan["bytes_down"] != last:
            last, since = wan["bytes_down"], time.monotonic()
        elif time.monotonic() - since >= quiet_s and wan["backlog_bytes"] == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the WAN never went quiet")


def assert_crossed_every_engine(journey) -> None:
    """P's first token, RLD's relay, then MD; if not, the journey's account of why, whole (a relay
    or MD failure in the decision, an early handoff, a failover, the transfers' times, each
    engine's prefix hits and first-token times)."""
    roles = [role for role, _ in journey["token_sources"]]
    assert journey["pipeline"] == "P-RLD-MD" and roles == ["prefill", "relay_decode", "main_decode"], pformat(
        {
            key: journey[key]
            for key in ("pipeline", "token_sources", "decision", "handoff", "failovers", "transfers", "hit_tokens", "engine_ttft_ms", "engine_queued_ms")
        }
    )
