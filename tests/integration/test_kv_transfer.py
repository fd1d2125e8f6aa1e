"""KV transfer between real engines: exact tokens, exact bytes, leases, faults."""

from __future__ import annotations

import itertools
import math
import random
import threading
import time

import pytest

from app.engine.cluster_tls import cluster_tls
from app.engine.kv.params import PRODUCE
from app.engine.token_channel import EngineRequest, SamplingOptions, TokenStreamClient
from app.ops.cluster import orphans
from app.ops.faults import Faults
from tests.conftest import local_args, set_wan
from tests.integration.conftest import completion, deploy_app
from tests.integration.relaying import api

BLOCK = 32
BYTES_PER_BLOCK = BLOCK * 4096  # dev model: 2 layers x K,V x 4 heads x 64 dims x fp32
HEADER_BOUND = 4096  # the pull's header and its TLS handshake


def wire_bound(nbytes: int) -> int:
    """Most bytes a pull of `nbytes` of KV puts on the link: TLS 1.3 adds 22 bytes per record
    of at most 16 KiB (header, content type, AEAD tag) to the header and handshake."""
    return nbytes + HEADER_BOUND + math.ceil(nbytes / 16384) * 22


LEASE_TIMEOUT_S = 4.0
WAN = "dc-a->dc-b"
INTRA = "dc-a->dc-a"


@pytest.fixture(scope="module")
def app(serve_instance):
    args = local_args()
    args["model"]["max_model_len"] = 8192
    args["kv"] = {"lease_timeout_s": LEASE_TIMEOUT_S, "transfer_timeout_s": 60}
    set_wan(args, 20, 20)
    deployed = deploy_app(serve_instance, "kv", args)
    yield deployed
    deployed.delete()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def link_bytes(app, direction: str) -> int:
    return Faults(app.name).link_counters(direction)["bytes_down"]


def leases_live(app) -> int:
    return app.handle("Prefill").kv_state.remote().result()["leases_live"]


def wait_leases(app, expected: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        live = leases_live(app)
        if live == expected or time.monotonic() > deadline:
            return live
        time.sleep(0.25)


@pytest.mark.parametrize("mode", ["pd_intra_dc", "pd_cross_dc_naive", "pd_cross_dc"])
def test_pd_modes_return_the_colocated_tokens(app, mode):
    prompt = tokens(hash(mode) % 1000, 700)
    text, journey = completion(app, prompt, 48, mode=mode)
    reference, _ = completion(app, prompt, 48, mode="colocated")
    assert text == reference
    assert journey["completion_tokens"] == 48
    expected_link = INTRA if mode == "pd_intra_dc" else WAN
    assert [t["link"] for t in journey["transfers"]] == [expected_link]
    transfer = journey["transfers"][0]
    assert transfer["ok"]
    # the only pull in flight found a free pull thread: its wait is measured, and short
    assert 0 < transfer["queued_seconds"] < 1


def test_naive_mode_ships_the_whole_prompt_every_turn(app):
    prompt = tokens(3, 640)
    completion(app, prompt, 8, mode="pd_cross_dc_naive")
    _, journey = completion(app, prompt, 8, mode="pd_cross_dc_naive")  # MD now holds it all
    assert journey["transfers"][0]["blocks"] == math.ceil(640 / BLOCK)
    assert journey["token_sources"] == [["main_decode", 8]]  # first token from the decoder side


def test_cross_dc_pd_pulls_only_what_the_conversations_decoder_lacks_streamed_or_not(app):
    """pd_cross_dc (vLLM's connectors as shipped): the second turn's decoder is the first's, and
    only the new tail's blocks cross the WAN; the first token still comes from the decoder side."""
    turn1 = tokens(13, 640)
    _, j1 = completion(app, turn1, 8, mode="pd_cross_dc")
    turn2 = turn1 + tokens(14, 300)
    text, j2 = completion(app, turn2, 24, mode="pd_cross_dc")
    streamed = "".join(
        chunk.choices[0].text
        for chunk in api(app).completions.create(
            model="pdd-dev", prompt=turn2, max_tokens=24, temperature=0, stream=True, extra_body={"pdd_mode": "pd_cross_dc"}
        )
        if chunk.choices
    )
    assert streamed == text == completion(app, turn2, 24, mode="colocated")[0]
    assert j2["pipeline"] == "P-D-cross" and j2["replicas"]["main_decode"] == j1["replicas"]["main_decode"]
    assert j2["hit_tokens"]["main_decode"] == 640 // BLOCK * BLOCK
    (transfer,) = j2["transfers"]
    assert transfer["link"] == WAN and transfer["blocks"] == math.ceil(940 / BLOCK) - 640 // BLOCK
    assert j2["token_sources"] == [["main_decode", 24]]


def test_second_turn_moves_only_the_new_blocks(app):
    turn1 = tokens(4, 1000)
    _, j1 = completion(app, turn1, 16, mode="pd_intra_dc")
    assert j1["transfers"][0]["blocks"] == math.ceil(1000 / BLOCK)
    turn2 = turn1 + tokens(5, 300)
    before = link_bytes(app, INTRA)
    _, j2 = completion(app, turn2, 16, mode="pd_intra_dc")
    moved = link_bytes(app, INTRA) - before
    expected_blocks = math.ceil(1300 / BLOCK) - 1000 // BLOCK
    t = j2["transfers"][0]
    assert t["blocks"] == expected_blocks
    assert t["bytes"] == expected_blocks * BYTES_PER_BLOCK
    assert t["bytes"] <= moved <= wire_bound(t["bytes"])
    assert j2["hit_tokens"]["relay_decode"] == 1000 // BLOCK * BLOCK


def test_lease_is_freed_after_the_pull(app):
    completion(app, tokens(6, 500), 8, mode="pd_intra_dc")
    assert wait_leases(app, 0, timeout_s=10) == 0


def test_unpulled_lease_expires(app):
    """A prefill whose decoder never comes: the blocks go back after the lease timeout."""
    p = next(iter(app_replicas(app, "Prefill")))
    client = TokenStreamClient(p["node_ip"], p["token_port"], cluster_tls().client)

    async def produce():
        request = EngineRequest("orphan-lease", tokens(7, 300), SamplingOptions(max_tokens=1, temperature=0), kv_transfer_params={PRODUCE: {"consumers": 1}})
        out = [d async for d in client.stream(request)]
        await client.close()
        return out

    import asyncio

    asyncio.run(produce())
    assert wait_leases(app, 1, timeout_s=5) == 1
    assert wait_leases(app, 0, timeout_s=LEASE_TIMEOUT_S + 10) == 0


def app_replicas(app, deployment: str) -> list[dict]:
    info = app.handle(deployment).describe.remote().result()
    return [vars(info)]


def test_cutting_the_wan_mid_transfer_recomputes_and_counts_the_failure(app):
    prompt = tokens(8, 2400)  # ~9.8 MB of KV: ~4 s over the 20 Mbit/s WAN
    result = {}

    def run():
        result["text"], result["journey"] = completion(app, prompt, 24, mode="pd_cross_dc_naive")

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(1.5)
    Faults(app.name).cut_link(WAN, 2.0)
    worker.join(120)
    reference, _ = completion(app, prompt, 24, mode="colocated")
    assert result["text"] == reference
    transfer = result["journey"]["transfers"][0]
    assert not transfer["ok"] and transfer["link"] == WAN
    assert 0 < transfer["blocks"] < math.ceil(2400 / BLOCK)
    assert wait_leases(app, 0, timeout_s=10) == 0


def test_killing_prefill_after_its_prefill_makes_decoders_recompute(app):
    """PDD, low hit: the first token comes from P, then P dies while MD's WAN pull runs."""
    # long enough that RLD is still decoding when MD, having lost its pull, has recomputed
    max_tokens = 256
    got: dict = {}

    def run(prompt: list[int]) -> None:
        got["text"], got["journey"] = completion(app, prompt, max_tokens, mode="pdd")

    wan_down: list[str] = []  # a loaded machine can miss the link emulator's polls: not this test's subject
    for attempt in range(3):
        wait_wan_up(app)  # an earlier test cut it
        prompt = tokens(9 + 10 * attempt, 2400)
        got.clear()
        worker = threading.Thread(target=run, args=(prompt,))
        worker.start()
        prefilled = _wait_prefilled(app, timeout_s=60)
        if prefilled["pipeline"] == "P-RLD-MD" or "wan_down" not in prefilled["decision"]:
            break
        wan_down.append(prefilled["decision"]["wan_down"])
        worker.join(180)
    time.sleep(0.3)
    Faults(app.name).kill_replica("Prefill")
    worker.join(180)
    deadline = time.monotonic() + 15  # the killed replica's engine processes follow it
    while orphans() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert orphans() == []
    assert "text" in got, "request did not finish"
    journey = got["journey"]
    assert journey["pipeline"] == "P-RLD-MD", (journey["decision"], wan_down)
    # Not asserted: MD's failed WAN pull in the journey. Its report does not reach the
    # journey when prefill dies mid-pull (a known gap, noted on the KV transfer issue).
    app.wait_running()
    reference, _ = completion(app, prompt, max_tokens, mode="colocated")
    assert got["text"] == reference


def wait_wan_up(app, timeout_s: float = 60) -> None:
    """Until the conductor routes over the WAN again: the link is no longer cut, and a one-token PDD
    probe gets past the WAN check (the routing's view refreshes every second, and on a loaded
    machine a slow link emulator can keep its datacenter counted cut off a few refreshes longer)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{app.base_url}/pdd/state", timeout=10).json()["links"].get(WAN, {"is_cut": True})["is_cut"]:
        assert time.monotonic() < deadline, "the WAN stayed cut"
        time.sleep(0.2)
    for probe in itertools.count():
        decision = completion(app, tokens(1000 + probe, 64), 1, mode="pdd")[1]["decision"]
        if not decision["reason"].startswith("WAN down"):
            return
        assert time.monotonic() < deadline, f"the conductor still routes as if the WAN were down: {decision}"
        time.sleep(0.5)


def _wait_prefilled(app, timeout_s: float) -> dict:
    """The journey of the one request in flight, once the conductor has seen its prefill finish."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        requests = httpx.get(f"{app.base_url}/pdd/requests", timeout=10).json()["requests"]
        prefilled = [j for j in requests if j["finished_at"] is None and "prefill" in j["hit_tokens"]]
        if prefilled:
            return prefilled[0]
        assert time.monotonic() < deadline, "no prefill finished"
        time.sleep(0.05)
