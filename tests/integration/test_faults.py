"""Faults under a batch of concurrent streaming requests (real engines, greedy).

Each request either completes with exactly the colocated tokens or ends with a
clear error; KV leases return to zero; the fault shows in the metrics.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from app.conductor.link_directory import LinkDirectory
from app.config import PDDConfig
from app.ops.cli import main as pdd
from app.ops.faults import Faults
from app.telemetry import metrics
from tests.conftest import local_args, set_wan
from tests.integration.conftest import completion, deploy_app, ray_prometheus

APP = "faults"
BLOCK = PDDConfig.model_validate(local_args()).model.block_size


@pytest.fixture(scope="module")
def app(serve_instance):
    args = local_args()
    args["roles"]["main_decode"]["replicas"] = 2
    args["kv"] = {"lease_timeout_s": 20, "transfer_timeout_s": 30}
    args["server"] = {"request_timeout_s": 240}
    set_wan(args, 20, 20)
    deployed = deploy_app(serve_instance, APP, args)
    yield deployed
    deployed.delete()


@pytest.fixture(scope="module")
def prom(app, tmp_path_factory):
    with ray_prometheus(tmp_path_factory.mktemp("prom")) as server:
        yield server


@pytest.fixture
def faults(app):
    yield Faults(APP, seed=0)
    app.wait_running()  # Serve has replaced what a test killed


_seed = iter(range(100_000))


def fresh(n: int) -> list[int]:
    rng = random.Random(7000 + next(_seed))
    return [rng.randrange(10, 500) for _ in range(n)]


class Batch:
    """Concurrent streaming requests; `started` is set once each has some tokens."""

    def __init__(self, app, prompts: list[list[int]], max_tokens: int, warm_tokens: int = 8, extra: dict | None = None):
        self.app, self.prompts, self.max_tokens, self.warm_tokens = app, prompts, max_tokens, warm_tokens
        self.extra = extra or {}
        self.texts: list[str | None] = [None] * len(prompts)
        self.errors: list[str | None] = [None] * len(prompts)
        self.ids: list[str] = [""] * len(prompts)

    async def run(self, fault) -> None:
        client = openai.AsyncOpenAI(base_url=self.app.v1, api_key="none", max_retries=0, timeout=300)
        started = [asyncio.Event() for _ in self.prompts]

        async def one(i: int) -> None:
            parts, tokens = [], 0
            try:
                stream = await client.completions.create(
                    model="pdd-dev",
                    prompt=self.prompts[i],
                    max_tokens=self.max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True, **self.extra},
                )
                async for chunk in stream:
                    self.ids[i] = chunk.id
                    if chunk.choices:
                        parts.append(chunk.choices[0].text)
                        tokens += len(chunk.choices[0].token_ids or [])
                        if tokens >= self.warm_tokens:
                            started[i].set()
                self.texts[i] = "".join(parts)
            except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
                self.errors[i] = f"{type(exc).__name__}: {exc}"
            finally:
                started[i].set()

        tasks = [asyncio.create_task(one(i)) for i in range(len(self.prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        await asyncio.to_thread(fault)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        await client.close()

    def check(self, app) -> list[dict]:
        """Every request: the colocated tokens, or a clear error. Returns the journeys."""
        journeys = []
        for i, prompt in enumerate(self.prompts):
            if self.errors[i] is not None:
                assert self.errors[i].strip() and "Error" in self.errors[i], self.errors[i]
                continue
            reference, _ = completion(app, prompt, self.max_tokens, mode="colocated", **self.extra)
            assert self.texts[i] == reference, f"request {i} diverged"
            journeys.append(app.journey(self.ids[i]))
        return journeys


def leases_back_to_zero(app, timeout_s: float = 40) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if app.handle("Prefill").kv_state.remote().result()["leases_live"] == 0:
                return True
        except Exception:  # noqa: BLE001 - the replica may be restarting
            pass
        time.sleep(0.5)
    return False


def counted(prom, app, spec, **labels) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in {"application": app.name, **labels}.items())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = prom.query(f"sum({metrics.prom_name(spec)}{{{selector}}})")
        if result and float(result[0]["value"][1]) > 0:
            return float(result[0]["value"][1])
        time.sleep(1)
    return 0.0


def wait_backlog_drained(app, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        links = httpx.get(f"{app.base_url}/pdd/state", timeout=30).json()["links"]
        if all(link["backlog_bytes"] == 0 for link in links.values()):
            return True
        time.sleep(0.5)
    return False


#: Far longer than 300 tokens: the answers run to max_tokens under the grammar, which the
#: replica taking over must continue from the tokens already sent, not from the start.
PAIRS = r"([a-z]{3}-[0-9]{2} ){200}"


def test_main_decoder_dies_mid_stream(app, faults, prom):
    # high-hit turns go P-MD: MD streams nearly every token
    prompts = [fresh(800) for _ in range(4)]
    for p in prompts:
        completion(app, p, 4)
    # the relay answered those: MD's warm-ups are still pulling, and a WAN backlog sends
    # the next turns through the relay; once MD holds the conversations they go P-MD
    assert wait_backlog_drained(app), "MD's warm-ups did not finish"
    batch = Batch(app, [p + fresh(20) for p in prompts], max_tokens=300, warm_tokens=20, extra={"structured_outputs": {"regex": PAIRS}})
    asyncio.run(batch.run(lambda: faults.kill_replica("MainDecode")))
    journeys = batch.check(app)
    assert not any(batch.errors), batch.errors
    assert all(re.fullmatch(r"([a-z]{3}-[0-9]{2} )*[a-z]{0,3}(-[0-9]{0,2})?", t) for t in batch.texts), batch.texts
    moved = [j for j in journeys if j["failovers"]]
    assert moved, ("the killed MD served none of the batch?", [(j["pipeline"], j["decision"], j.get("handoff")) for j in journeys])
    for j in moved:
        f = j["failovers"][0]
        assert f["from_role"] == "main_decode" and f["at_token"] >= 20
        assert j["completion_tokens"] == 300
    assert counted(prom, app, metrics.FAILOVERS, from_role="main_decode") >= len(moved)
    assert leases_back_to_zero(app)


def test_relay_decoder_dies_during_the_relay(app, faults):
    # low hit, long output: relays in flight when RLD dies; the prefill replica relays on
    # from the tokens sent, then MD takes over as from RLD
    batch = Batch(app, [fresh(2400) for _ in range(3)], max_tokens=400, warm_tokens=12)
    asyncio.run(batch.run(lambda: faults.kill_replica("RelayDecode")))
    journeys = batch.check(app)
    assert not any(batch.errors), batch.errors
    failed = [j for j in journeys if "rld_failure" in j["decision"]]
    assert failed, [j["decision"] for j in journeys]
    for j in failed:
        f = j["failovers"][0]
        assert (f["from_role"], f["to_role"], f["to_replica"]) == ("relay_decode", "prefill", j["replicas"]["prefill"]), j["failovers"]
    # MD's pull outlasts the few tokens RLD made: P streamed between RLD and MD
    assert any([role for role, _ in j["token_sources"]][1:3] == ["relay_decode", "prefill"] for j in failed), [j["token_sources"] for j in failed]
    # MD took over, or P's relay finished the request first (MD then catches up on it)
    assert all(j["token_sources"][-1][0] == "main_decode" or j["handoff"]["reason"] == "relay finished the request" for j in journeys)
    assert leases_back_to_zero(app)


def conductor_routes_to_a_relay(app, timeout_s: float = 180) -> bool:
    """Serve's status can still read healthy before it saw the last kill: wait for the conductor's view."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{app.base_url}/pdd/state", timeout=30).json()["roles"]["relay_decode"]["replicas"]:
            return True
        time.sleep(1)
    return False


def test_prefill_relays_while_the_relay_decoder_is_replaced(app, faults):
    assert conductor_routes_to_a_relay(app), "the relay decoder killed by an earlier test did not come back"
    faults.kill_replica("RelayDecode")
    # the first turns may still meet the dead replica (then MD takes over); the conductor
    # stops routing to it, and until Serve's replacement is up P relays
    deadline = time.monotonic() + 60
    turns, readiness = [], []
    while time.monotonic() < deadline and not any(j["pipeline"] == "P-P-MD" for _, _, j in turns):
        prompt = fresh(2400)
        turns.append((prompt, *completion(app, prompt, 40)))
        ready = httpx.get(f"{app.base_url}/ready", timeout=30)
        readiness.append((ready.status_code, ready.json()["status"], ready.json()["missing"]))
    relayed = [(prompt, text, j) for prompt, text, j in turns if j["pipeline"] == "P-P-MD"]
    assert relayed, [(j["pipeline"], j["decision"]) for _, _, j in turns]
    # a load balancer keeps sending: the app still serves, and says what it lacks
    assert readiness[-1] == (200, "degraded", ["relay_decode"]), readiness
    prompt, text, j = relayed[0]
    assert text == completion(app, prompt, 40, mode="colocated")[0]
    assert "prefill relays" in j["decision"]["reason"]
    assert j["token_sources"][0][0] == "prefill" and j["token_sources"][0][1] > 1, j["token_sources"]
    assert "relay_decode" not in j["replicas"]
    assert leases_back_to_zero(app)


def test_prefill_dies_before_its_kv_is_pulled(app, faults):
    batch = Batch(app, [fresh(2400) for _ in range(3)], max_tokens=200, warm_tokens=1)
    asyncio.run(batch.run(lambda: faults.kill_replica("Prefill")))
    journeys = batch.check(app)
    assert not any(batch.errors), batch.errors
    assert any(not t["ok"] for j in journeys for t in j["transfers"]), "no pull broke?"


def test_wan_outage(app, faults):
    """In-flight requests finish; new ones route around the cut; nothing hangs."""
    direction = "dc-a->dc-b"
    batch = Batch(app, [fresh(2400) for _ in range(3)], max_tokens=200, warm_tokens=4)
    try:
        # cut until restored: a timed cut could heal before the probe on a slow machine
        asyncio.run(batch.run(lambda: faults.cut_link(direction)))
        batch.check(app)
        assert not any(batch.errors), batch.errors
        t0 = time.monotonic()
        text, journey = completion(app, fresh(1500), 40)
        assert journey["pipeline"] == "P-RLD" and "WAN down" in journey["decision"]["reason"]
        assert journey["decision"]["wan_down"] == f"{direction} cut"
        assert time.monotonic() - t0 < 30  # no wait for the transfer timeout
    finally:
        faults.restore_link(direction)
    time.sleep(LinkDirectory.HEALTH_TTL_S + 0.5)  # how stale the conductor's view of the links may be
    _, journey = completion(app, fresh(1500), 40)
    assert journey["pipeline"] in ("P-RLD-MD", "P-MD")
    assert leases_back_to_zero(app)


def pdd_fault(*args: str, exit_code: int = 0) -> str:
    """`pdd fault ARGS` against the test app, through the connection this process already has to its cluster."""
    import ray

    result = CliRunner().invoke(pdd, ["fault", *args, "--app-name", APP, "--address", ray.get_runtime_context().gcs_address], env={"COLUMNS": "200"})
    assert result.exit_code == exit_code, result.output
    return " ".join(result.output.split())


def test_pdd_fault_cuts_slows_and_restores_a_link_and_names_what_it_cannot_find(app, faults):
    direction = "dc-a->dc-b"
    configured = faults.link_counters(direction)["bandwidth_mbps"], faults.link_counters(direction)["rtt_ms"]
    try:
        assert pdd_fault("cut", direction) == f"{direction} cut until `pdd fault restore`"
        assert faults.link_counters(direction)["is_cut"]
        assert pdd_fault("restore", direction) == f"{direction} restored to its configured figures"
        assert not faults.link_counters(direction)["is_cut"]
        assert pdd_fault("slow", direction, "--bandwidth-mbps", "5", "--rtt-ms", "80") == f"{direction} slowed to 5 Mbit/s, RTT 80 ms until `pdd fault restore`"
        assert (faults.link_counters(direction)["bandwidth_mbps"], faults.link_counters(direction)["rtt_ms"]) == (5, 80)
        pdd_fault("restore", direction)
        assert (faults.link_counters(direction)["bandwidth_mbps"], faults.link_counters(direction)["rtt_ms"]) == configured != (5, 80)
    finally:
        faults.restore_link(direction)
    assert "known: dc-a->dc-b" in pdd_fault("cut", "dc-c->dc-b", exit_code=1)
    assert "no link emulator receives in 'dc-z'" in pdd_fault("stall", "dc-a->dc-z", "3", exit_code=1)
    assert "a link direction reads like dc-a->dc-b, not 'dc-b'" in pdd_fault("cut", "dc-b", exit_code=1)
    assert "--bandwidth-mbps" in pdd_fault("slow", direction, exit_code=2)


def test_stalled_wan_is_bounded_by_the_transfer_timeout(app, faults):
    assert pdd_fault("stall", "dc-a->dc-b", "3") == "dc-a->dc-b stalled for 3 s"
    text, journey = completion(app, fresh(2400), 60)
    assert journey["completion_tokens"] == 60
    assert leases_back_to_zero(app)


def test_expired_leases_make_decoders_recompute(app, faults):
    prompt = fresh(2400)
    batch = Batch(app, [prompt], max_tokens=200, warm_tokens=1)
    asyncio.run(batch.run(faults.expire_leases))
    batch.check(app)
    assert not any(batch.errors), batch.errors
    assert leases_back_to_zero(app, timeout_s=5)


def test_conductor_restart(app, faults):
    batch = Batch(app, [fresh(600) for _ in range(2)], max_tokens=400, warm_tokens=8)
    asyncio.run(batch.run(faults.restart_conductor))
    assert all(e is None or "Error" in e for e in batch.errors)  # dropped connections are clear errors
    app.wait_running()
    deadline = time.monotonic() + 120
    while True:  # the new conductor takes requests again
        try:
            text, journey = completion(app, fresh(300), 10)
            break
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    assert journey["completion_tokens"] == 10


def restart_conductor_and_wait(app, faults, main_decoders: int = 2, timeout_s: float = 120, forget_index: bool = False) -> None:
    """A new conductor (its index empty with `forget_index`) that sees every main decoder and has nothing in flight."""
    faults.restart_conductor(forget_index)
    wait_new_conductor(app, main_decoders, timeout_s)


def wait_new_conductor(app, main_decoders: int = 2, timeout_s: float = 120) -> None:
    app.wait_running()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = app.state()
            if len(state["roles"]["main_decode"]["replicas"]) == main_decoders and state["in_flight"] == 0:
                return
        except httpx.HTTPError:
            pass  # Serve still routes to the replica that was killed
        if time.monotonic() > deadline:
            raise TimeoutError("the new conductor never saw every main decoder")
        time.sleep(1)


def wait_decoders_idle(app, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r["in_flight"] for r in app.state()["roles"]["main_decode"]["replicas"]):
        if time.monotonic() > deadline:
            raise TimeoutError("a main decoder kept a request in flight")
        time.sleep(0.2)


def test_a_new_conductor_sends_no_turn_behind_kv_a_decoder_already_held(app, faults):
    """A restarted conductor without a saved index knows none of the main decoders' caches: a returning conversation's
    turn is expected to send its whole context over the WAN, and the decoder that still holds
    it pulls one block. What it did not pull must leave routing's WAN backlog when its decoder
    says so, or the turns after it wait behind bytes that never cross.

    From the same empty index, on idle replicas, the same turns go to the same main decoders:
    served once after one restart, then again after another, they find their contexts there."""
    conversations = [fresh(1000) for _ in range(4)]
    knobs = {"routing": {**app.args["routing"], "max_wan_transfer_ms": 60_000}, "handoff": app.args["handoff"]}
    app.set_user_config("Conductor", knobs)  # every turn P-MD: MD's pull is the turn's, and ends with it
    try:
        restart_conductor_and_wait(app, faults, forget_index=True)
        first = []
        for prompt in conversations:
            assert wait_backlog_drained(app)
            wait_decoders_idle(app)
            first.append(completion(app, prompt, 4)[1])
        assert wait_backlog_drained(app)
        restart_conductor_and_wait(app, faults, forget_index=True)
        for prompt, before in zip(conversations, first):
            wait_decoders_idle(app)
            _, journey = completion(app, prompt, 4)
            assert journey["replicas"]["main_decode"] == before["replicas"]["main_decode"], "routing from an empty index is not repeatable?"
            assert journey["hit_tokens"]["main_decode"] >= len(prompt) // BLOCK * BLOCK - BLOCK, journey["hit_tokens"]
            assert journey["decision"]["blocks_to_send"] == before["decision"]["blocks_to_send"]  # the whole context, again
            # on an idle link, as the first time: the turn before it left no phantom bytes queued
            assert journey["decision"]["expected_wan_ms"] <= 1.05 * before["decision"]["expected_wan_ms"], (journey["decision"], before["decision"])
            (wan,), (whole,) = ([t for t in j["transfers"] if t["link"] == "dc-a->dc-b"] for j in (journey, before))
            assert wan["bytes"] < whole["bytes"] / 10
    finally:
        app.set_user_config("Conductor", {"routing": app.args["routing"], "handoff": app.args["handoff"]})


def wait_index_saved(app, timeout_s: float = 60) -> None:
    """Until the conductor has saved its prefix index since now."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while (app.state().get("prefix_index_saved_at") or 0) <= since:
        if time.monotonic() > deadline:
            raise TimeoutError("the conductor never saved its prefix index")
        time.sleep(0.5)


def test_a_new_conductor_starts_from_the_index_the_last_one_saved(app, faults):
    """After a restart, a returning conversation's next turn is routed on what its main
    decoder holds: P-MD with only the new blocks to send, as before the restart, not
    P-RLD-MD with its whole context expected to cross the WAN."""
    conversations = [fresh(1000) for _ in range(2)]
    knobs = {"routing": {**app.args["routing"], "max_wan_transfer_ms": 60_000}, "handoff": app.args["handoff"]}
    app.set_user_config("Conductor", knobs)  # the first turns P-MD: their contexts on MD once they end
    try:
        first = [completion(app, prompt, 4)[1] for prompt in conversations]
    finally:
        app.set_user_config("Conductor", {"routing": app.args["routing"], "handoff": app.args["handoff"]})
    assert wait_backlog_drained(app)
    wait_index_saved(app)
    assert pdd_fault("restart-conductor").endswith("; Serve starts another, from the saved prefix index")
    wait_new_conductor(app)
    for prompt, before in zip(conversations, first):
        wait_decoders_idle(app)
        _, journey = completion(app, prompt + fresh(40), 4)
        assert journey["pipeline"] == "P-MD", journey["decision"]
        assert journey["replicas"]["main_decode"] == before["replicas"]["main_decode"]
        assert journey["decision"]["md_hit_estimate"] > 0.9 and journey["decision"]["blocks_to_send"] <= 3, journey["decision"]
