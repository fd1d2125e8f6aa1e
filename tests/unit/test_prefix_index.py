from app.conductor.prefix_index import PrefixIndex, block_keys


def test_keys_chain_so_a_block_depends_on_everything_before_it():
    a = block_keys(list(range(96)), 32)
    b = block_keys([999] + list(range(1, 96)), 32)
    assert len(a) == 3 and len(block_keys(list(range(95)), 32)) == 2
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every key
    assert block_keys(list(range(64)), 32) == a[:2]


def test_conversation_sticks_to_the_replica_holding_it():
    idx = PrefixIndex(32)
    turn1 = list(range(300))
    idx.record("md-1", idx.keys(turn1), 1000)
    turn2 = turn1 + list(range(1000, 1100))
    choice = idx.choose({"md-0": 1000, "md-1": 1000}, idx.keys(turn2), load=lambda rid: 0)
    assert choice.replica_id == "md-1" and choice.cached_tokens == 288


def test_overloaded_replica_loses_affinity():
    idx = PrefixIndex(32, imbalance_limit=4)
    idx.record("md-1", idx.keys(list(range(320))), 1000)
    loads = {"md-0": 0, "md-1": 5}
    choice = idx.choose({"md-0": 1000, "md-1": 1000}, idx.keys(list(range(320))), load=loads.get)
    assert choice.replica_id == "md-0" and choice.cached_tokens == 0


def test_a_replica_with_room_keeps_its_conversations_however_busy():
    """A decoder below its batch limit (`room`) is not overloaded, whatever the idlest runs."""
    idx = PrefixIndex(32, imbalance_limit=4)
    keys = idx.keys(list(range(320)))
    idx.record("md-1", keys, 1000)
    replicas = {"md-0": 1000, "md-1": 1000}
    assert idx.choose(replicas, keys, load={"md-0": 0, "md-1": 63}.get, room=64).replica_id == "md-1"
    assert idx.choose(replicas, keys, load={"md-0": 0, "md-1": 64}.get, room=64).replica_id == "md-0"
    assert idx.choose(replicas, keys, load={"md-0": 60, "md-1": 64}.get, room=64).replica_id == "md-1", "within the imbalance limit"


def test_ties_go_to_the_idlest():
    idx = PrefixIndex(32)
    choice = idx.choose({"a": 10, "b": 10}, idx.keys(list(range(64))), load={"a": 3, "b": 1}.get)
    assert choice.replica_id == "b"


def test_engine_report_corrects_evictions():
    idx = PrefixIndex(32)
    keys = idx.keys(list(range(320)))
    idx.record("md", keys, 1000)
    assert idx.estimate("md", keys) == 320
    idx.observe("md", keys, actual_cached_tokens=64)
    assert idx.estimate("md", keys) == 64


def test_capacity_is_lru_bounded():
    idx = PrefixIndex(32)
    idx.record("md", [1, 2, 3], capacity_blocks=3)
    idx.record("md", [1], capacity_blocks=3)  # touch 1
    idx.record("md", [4], capacity_blocks=3)
    assert idx.estimate("md", [1]) == 32 and idx.estimate("md", [2]) == 0


def test_routed_blocks_keep_affinity_but_are_not_counted_as_held():
    """A turn routed to md-1 and still running: the next turn goes there too,
    but expects no hit until the first one is confirmed."""
    idx = PrefixIndex(32)
    keys = idx.keys(list(range(320)))
    replicas = {"md-0": 1000, "md-1": 1000}
    idx.route("md-1", keys, 1000)
    choice = idx.choose(replicas, keys, load=lambda rid: 0)
    assert choice.replica_id == "md-1" and choice.cached_tokens == 0
    idx.record("md-1", keys, 1000)
    assert idx.choose(replicas, keys, load=lambda rid: 0).cached_tokens == 320
    idx.unroute("md-1", keys)  # confirmed blocks stay
    assert idx.estimate("md-1", keys) == 320


def test_unroute_forgets_unconfirmed_blocks():
    idx = PrefixIndex(32)
    keys = idx.keys(list(range(320)))
    idx.route("md-1", keys, 1000)
    idx.unroute("md-1", keys)
    assert idx.choose({"md-0": 1000, "md-1": 1000}, keys, load=lambda rid: {"md-0": 0, "md-1": 1}[rid]).replica_id == "md-0"


def test_new_conversations_spread_and_stay_put():
    idx = PrefixIndex(32)
    replicas = {"md-0": 1000, "md-1": 1000, "md-2": 1000}
    picks = {}
    for conv in range(60):
        keys = idx.keys([conv] * 64)
        picks[conv] = idx.choose(replicas, keys, load=lambda rid: 0).replica_id
        assert idx.choose(replicas, keys, load=lambda rid: 0).replica_id == picks[conv]  # stable
    counts = [list(picks.values()).count(r) for r in replicas]
    assert min(counts) >= 10, counts


def test_a_restored_index_estimates_and_evicts_as_the_saved_one():
    saved = PrefixIndex(32)
    saved.record("md", [1, 2, 3], capacity_blocks=3)
    saved.record("md", [1], capacity_blocks=3)  # 2 is now the least recently used
    restored = PrefixIndex(32)
    restored.restore("md", *saved.snapshot("md"))
    assert restored.snapshot("md") == saved.snapshot("md") == (3, [2, 3, 1])
    assert restored.estimate("md", [1]) == 32
    restored.record("md", [4], capacity_blocks=3)
    assert restored.estimate("md", [2]) == 0 and restored.estimate("md", [3]) == 32


def test_changes_count_what_a_snapshot_holds_and_gone_replicas_are_forgotten():
    idx = PrefixIndex(32)
    assert idx.changes("md") == -1
    idx.record("md", [1, 2], capacity_blocks=10)
    idx.record("p", [1, 2], capacity_blocks=10)
    recorded = idx.changes("md")
    idx.route("md", [5], capacity_blocks=10)  # routed, not confirmed: not in a snapshot
    assert idx.changes("md") == recorded
    idx.observe("md", [1, 2], actual_cached_tokens=32)
    assert idx.changes("md") > recorded and idx.held_blocks("md") == 1
    assert idx.forget_all_but({"p", "rld"}) == ["md"]
    assert idx.known_replicas() == ["p"] and idx.held_blocks("md") == 0
