"""The benchmark harness: seeded traces, the JSONL loader, Belady's optimum against brute
force, replays (bytes checked), the `tiercache bench` command, and the batched policy and
single-tier manager fast paths the harness pushed for (checked against the plain paths)."""

from __future__ import annotations

import copy
import itertools
import json
from functools import cache

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

import tests.test_manager as tm
from tiercache.benchharness.belady import belady, next_uses
from tiercache.benchharness.replay import replay_cache, replay_manager
from tiercache.benchharness.runner import BenchOptions, run_bench
from tiercache.benchharness.traces import GENERATORS, TraceError, load_jsonl, make_trace
from tiercache.cli import main
from tiercache.hashing import prefix_hashes
from tiercache.policies import ARCPolicy, LRUPolicy


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


# -- synthetic traces ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_by_seed(name: str) -> None:
    a, b = make_trace(name, 60, seed=3), make_trace(name, 60, seed=3)
    assert a == b and len(a.requests) == 60
    assert make_trace(name, 60, seed=4).requests != a.requests
    # Every request is a chain of distinct 16-byte keys; arrivals never go backwards.
    for r in a.requests:
        assert r and len(set(r)) == len(r) and all(len(k) == 16 for k in r)
    assert all(x <= y for x, y in itertools.pairwise(a.timestamps))


def test_generators_have_their_reuse_shapes() -> None:
    chat = make_trace("chat", 200)
    # Chats share system prompts: few distinct first blocks, and real reuse overall.
    assert len({r[0] for r in chat.requests}) <= 8
    assert chat.unique_blocks < chat.n_blocks / 3
    agentic = make_trace("agentic", 200)
    # Agent loops resend a long shared prefix: the first 100 blocks come in only 4 variants.
    assert len({r[:100] for r in agentic.requests}) <= 4
    scan = make_trace("scan", 200)
    # Scans are mostly one-off blocks.
    assert scan.unique_blocks > 0.6 * scan.n_blocks


def test_make_trace_rejects_unknown_names_and_sizes() -> None:
    with pytest.raises(ValueError, match="unknown trace 'nope'"):
        make_trace("nope", 5)
    with pytest.raises(ValueError, match="requests"):
        make_trace("chat", 0)


# -- JSONL loader --------------------------------------------------------------------------
def write_lines(tmp_path, *lines: object):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_load_mooncake_style_hash_ids_in_timestamp_order(tmp_path) -> None:
    p = write_lines(
        tmp_path,
        {"timestamp": 30, "input_length": 9, "hash_ids": [1, 2, 3]},
        "",
        {"timestamp": 10, "hash_ids": [1, 2]},
    )
    t = load_jsonl(p)
    # Sorted by timestamp; ids become 16-byte big-endian keys; blank lines are skipped.
    assert t.timestamps == (10.0, 30.0)
    assert t.requests == ((K(1), K(2)), (K(1), K(2), K(3)))
    assert t.name == "trace" and t.unique_blocks == 3


def test_load_token_ids_and_hex_hashes(tmp_path) -> None:
    toks = list(range(40))
    p = write_lines(
        tmp_path,
        {"timestamp": 1.5, "token_ids": toks},
        {"timestamp": 2, "block_hashes": [K(7).hex()]},
        {"timestamp": 3, "token_ids": [1, 2]},  # no full block: skipped
    )
    t = load_jsonl(p, block_size=16, namespace="ns")
    assert t.requests[0] == tuple(prefix_hashes(toks, 16, namespace="ns"))
    assert t.requests[1] == (K(7),) and len(t.requests) == 2


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"trace.jsonl:2: not valid JSON"),
        ("[1, 2]", r":2: expected a JSON object"),
        ({"hash_ids": [1]}, r":2\.timestamp: expected a number"),
        ({"timestamp": True, "hash_ids": [1]}, r"timestamp: expected a number"),
        ({"timestamp": 1}, r"exactly one of 'hash_ids'"),
        ({"timestamp": 1, "hash_ids": [1], "token_ids": [1]}, r"exactly one of"),
        ({"timestamp": 1, "hash_ids": 5}, r"hash_ids: expected a list"),
        ({"timestamp": 1, "hash_ids": [1, -2]}, r"hash_ids\[1\]: block id -2 is outside"),
        ({"timestamp": 1, "hash_ids": [1.5]}, r"hash_ids\[0\]: expected an integer"),
        ({"timestamp": 1, "hash_ids": [3, 3]}, r"repeats a block id"),
        ({"timestamp": 1, "block_hashes": ["zz"]}, r"block_hashes\[0\]: 'zz' is not a hex"),
        ({"timestamp": 1, "block_hashes": ["abcd"]}, r"expected 32 hex digits"),
        ({"timestamp": 1, "token_ids": [1, "x"]}, r":2\.token_ids: "),
    ],
)
def test_loader_errors_name_the_line_and_field(tmp_path, line: object, match: str) -> None:
    p = write_lines(tmp_path, {"timestamp": 0, "hash_ids": [9]}, line)
    with pytest.raises(TraceError, match=match):
        load_jsonl(p)


def test_loader_rejects_missing_and_empty_files(tmp_path) -> None:
    with pytest.raises(TraceError, match="no such trace file"):
        load_jsonl(tmp_path / "absent.jsonl")
    p = write_lines(tmp_path, {"timestamp": 0, "token_ids": [1, 2, 3]})
    with pytest.raises(TraceError, match="holds no request with a full block"):
        load_jsonl(p)


# -- Belady --------------------------------------------------------------------------------
def brute_force_block_hits(requests: list[list[bytes]], capacity: int) -> int:
    """Most block hits any policy can get: on each miss, keep the cache, or admit the block
    (evicting any one resident block when full). Exhaustive, so only for tiny traces."""
    seq = tuple(k for r in requests for k in r)

    @cache
    def best(i: int, resident: frozenset) -> int:
        if i == len(seq):
            return 0
        k = seq[i]
        if k in resident:
            return 1 + best(i + 1, resident)
        options = [best(i + 1, resident)]  # bypass
        if len(resident) < capacity:
            options.append(best(i + 1, resident | {k}))
        else:
            options += [best(i + 1, (resident - {v}) | {k}) for v in resident]
        return max(options)

    return best(0, frozenset())


def test_belady_hand_checked() -> None:
    a, b, c = K(1), K(2), K(3)
    # a b c a b with room for 2: keep a and b, bypass c (never reused): 2 hits.
    r = belady([[a], [b], [c], [a], [b]], 2)
    assert (r.block_hits, r.prefix_hits, r.blocks) == (2, 2, 5)
    # a b c b a c, room for 2: MIN evicts the block used furthest ahead: hits on b, a or c...
    # a,b miss; c: next uses a@4, b@3, c@5 -> bypass c; b hit; a hit; c miss: 2 hits.
    assert belady([[a], [b], [c], [b], [a], [c]], 2).block_hits == 2
    # Chains: [a b] twice with room for 1 keeps a (the head): one prefix hit.
    r = belady([[a, b], [a, b]], 1)
    assert (r.prefix_hits, r.block_hits) == (1, 1)
    assert r.hit_rate == 0.25
    assert next_uses([5, 6, 5, 5]) == [2, 1 << 62, 3, 1 << 62]
    with pytest.raises(ValueError, match="capacity"):
        belady([[a]], 0)


small_traces = st.lists(
    st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True).map(
        lambda xs: [K(x) for x in xs]
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(requests=small_traces, capacity=st.integers(1, 3))
def test_belady_matches_brute_force(requests, capacity: int) -> None:
    r = belady(requests, capacity)
    assert r.block_hits == brute_force_block_hits(requests, capacity)
    assert r.prefix_hits <= r.block_hits


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 40))
def test_no_online_policy_beats_belady(seed: int, capacity: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(30):  # chains over a small shared key space
        start, n = int(rng.integers(0, 5)), int(rng.integers(1, 8))
        reqs.append(tuple(K(start * 100 + j) for j in range(n)))
    trace = make_trace("chat", 1).__class__("t", tuple(reqs), tuple(range(30)))
    ceiling = belady(trace.requests, capacity).block_hits
    for pol in ("lru", "arc"):
        assert replay_manager(trace, pol, capacity).hits <= ceiling


# -- replays --------------------------------------------------------------------------------
def test_replay_manager_counts_ops_and_hits() -> None:
    t = make_trace("chat", 80)
    r = replay_manager(t, "arc", 10_000)  # room for everything: only first sightings miss
    assert r.blocks == t.n_blocks and r.ops == 4 * t.n_blocks
    assert r.hits == t.n_blocks - t.unique_blocks
    assert r.seconds > 0 and r.ops_per_s > 0


def test_replay_manager_calls_in_vllm_scheduler_order(monkeypatch) -> None:
    """Per request: lookup, touch (of what is held: the hits count as used before the store
    makes room), load of the hits, store of the rest. Nothing is touched after its store."""
    from tiercache.manager import OffloadingManager

    calls: list[tuple[str, tuple[bytes, ...]]] = []
    names = ("lookup", "touch", "prepare_load", "complete_load", "prepare_store", "complete_store")
    for name in names:
        real = getattr(OffloadingManager, name)

        def rec(self, keys, *a, _n=name, _r=real, **kw):
            calls.append((_n, tuple(keys)))
            return _r(self, keys, *a, **kw)

        monkeypatch.setattr(OffloadingManager, name, rec)
    t = make_trace("chat", 40)
    run = replay_manager(t, "arc", 200)
    per_req: list[list[tuple[str, tuple[bytes, ...]]]] = []
    for c in calls:
        if c[0] == "lookup":
            per_req.append([])
        per_req[-1].append(c)
    assert len(per_req) == len(t.requests)
    for req, keys in zip(per_req, t.requests, strict=True):
        hit = len(dict(req).get("prepare_load", ()))
        order = [n for n, _ in req]
        expect = ["lookup", "touch"] + ["prepare_load", "complete_load"] * bool(hit)
        expect += ["prepare_store", "complete_store"] * (hit < len(keys))
        assert order in (expect, expect[:-1])  # a refused store completes nothing
        assert dict(req)["touch"] == keys
    assert run.hits == sum(len(dict(r).get("prepare_load", ())) for r in per_req)


def test_replay_cache_moves_checked_bytes_through_real_tiers(tmp_path) -> None:
    t = make_trace("chat", 40)
    longest = max(map(len, t.requests))
    assert longest < t.unique_blocks / 2
    cfg = {
        "block_size": 16,
        "namespace": "test",
        "tiers": [
            # Room for the longest chain (a longer one keeps only its head), not for all.
            {"kind": "cpu", "blocks": longest, "policy": "arc", "pin_memory": False},
            {"kind": "lmdb", "blocks": 4000, "path": str(tmp_path / "l"), "compression": "none"},
        ],
    }
    r = replay_cache(t, cfg, 256)
    # Every block is eventually found: the LMDB tier holds the whole footprint.
    assert r.hits == t.n_blocks - t.unique_blocks
    cpu, lm = r.tiers
    # Bytes moved are whole blocks, and every block the CPU tier stored was written there.
    assert cpu.write_bytes == r.stats["cpu"]["stored"] * 256
    assert lm.write_bytes == r.stats["lmdb"]["stored"] * 256 > 0
    assert r.stats["lmdb"]["hits"] > 0 and r.stats["cpu"]["hits"] > 0
    assert r.bytes_moved == sum(io.read_bytes + io.write_bytes for io in r.tiers)


# -- the command --------------------------------------------------------------------------
def test_bench_cli_tiny_full_run_writes_report_plot_and_json(tmp_path) -> None:
    out = tmp_path / "out"
    args = ["bench", "--traces", "chat", "--requests", "40", "--cache-requests", "15"]
    args += ["--runs", "1", "--no-vllm", "--out", str(out), "--dir", str(tmp_path / "d")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "prefix hashing" in r.output and "Belady" in r.output
    md = (out / "report.md").read_text()
    assert "## Ratios against same-run baselines" in md and "| chat |" in md
    assert (out / "hitrate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "report.json").read_text())
    assert {x["name"] for x in data["ratios"]} >= {"NVMe tier write", "CPU tier read"}
    # Seven capacities on the curve, each with Belady at least as high as LRU and ARC.
    pts = data["curves"]
    assert len(pts) == 7
    for p in pts:
        h = p["hit_rates"]
        assert h["belady"] >= max(h["tiercache lru"], h["tiercache arc"]) - 1e-12


def test_bench_cli_user_trace_and_errors(tmp_path) -> None:
    p = write_lines(
        tmp_path, *({"timestamp": i, "hash_ids": list(range(i % 5, 12))} for i in range(30))
    )
    args = ["bench", "--quick", "--traces", "none", "--trace-file", str(p), "--runs", "1"]
    r = CliRunner().invoke(main, [*args, "--no-vllm", "--json", "--dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert [t["name"] for t in data["traces"]] == ["trace"]
    assert data["cache"][0]["run"]["trace"] == "trace"
    # A bad trace is one line on stderr and exit code 2, no traceback.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "hash_ids": "x"}\n')
    r = CliRunner().invoke(main, ["bench", "--quick", "--traces", "none", "--trace-file", str(bad)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "bad.jsonl:1.hash_ids: expected a list" in r.output
    r = CliRunner().invoke(main, ["bench", "--traces", "chat,nope"])
    assert r.exit_code == 2 and "unknown trace 'nope'" in r.output


def test_run_bench_requires_some_trace() -> None:
    with pytest.raises(ValueError, match="nothing to run"):
        run_bench(BenchOptions(traces=()))


# -- the fast paths the harness asked for ---------------------------------------------------
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert_many", "insert_many_new", "touch", "evict", "protect", "remove"]),
        st.lists(st.integers(0, 15), max_size=6, unique=True),
    ),
    max_size=40,
)


class _Filtering:
    """A protected-key container that is not a set, so policies must filter key by key."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = set(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __bool__(self) -> bool:
        return bool(self._keys)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from([LRUPolicy, ARCPolicy]), cap=st.integers(1, 6), steps=ops)
def test_insert_many_equals_insert_one_by_one(policy, cap: int, steps) -> None:
    fast, slow = policy(cap), policy(cap)
    for op, xs in steps:
        keys = [K(x) for x in xs]
        if op == "insert_many":
            fast.insert_many(keys)
            for k in keys:
                slow.insert(k)
        elif op == "insert_many_new":  # what the manager vouches for: none of them resident
            keys = [k for k in keys if k not in fast]
            fast.insert_many(keys, new=True)
            for k in keys:
                slow.insert(k)
        elif op == "protect":  # evict all but the protected keys (the slow one filters)
            n = max(0, len(fast) - len(keys))
            got = fast.evict(n, set(keys))
            assert got == slow.evict(n, _Filtering(keys))
            assert got is None or not set(got) & set(keys)
        elif op == "touch":
            fast.touch(keys)
            slow.touch(keys)
        elif op == "remove":
            for k in keys:
                fast.remove(k)
                slow.remove(k)
        else:
            n = min(len(keys), len(fast))
            assert fast.evict(n) == slow.evict(n)
        assert list(fast.keys_in_eviction_order()) == list(slow.keys_in_eviction_order())
        if isinstance(fast, ARCPolicy):
            assert fast.state() == slow.state()


def test_single_tier_pins_with_repeated_keys() -> None:
    m = tm.make(3)
    tm.store(m, tm.chain(0, 3))
    a = tm.K(0)
    # Two loads of one block pin it twice; one completion leaves it pinned.
    m.prepare_load([a, a])
    m.complete_load([a])
    assert m.stats()["t0"]["pinned_blocks"] == 1
    # A pinned block survives a store that needs every other slot...
    out = m.prepare_store(tm.chain(10, 12))
    assert out is not None and a not in out.evicted_keys
    # ...and one more completion than loads raises and changes nothing.
    with pytest.raises(KeyError, match="no outstanding load"):
        m.complete_load([a, a])
    assert m.stats()["t0"]["pinned_blocks"] == 1
    m.complete_load([a])
    assert m.stats()["t0"]["pinned_blocks"] == 0
    with pytest.raises(KeyError, match="not ready"):
        m.prepare_load([tm.K(10)])  # reserved, not complete


class SingleTierMachine(tm.ManagerMachine):
    """The manager state machine on one tier, where the manager takes its fast paths."""

    @initialize(policy=st.sampled_from([LRUPolicy, ARCPolicy]), cap0=st.integers(1, 5))
    def start(self, policy, cap0: int) -> None:
        self.m = tm.make(cap0, policy=policy)
        self.pending = {}
        self.next_id = 0
        self.pins = []
        self.replayed = {"t0": set()}


SingleTierMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestSingleTierMachine = SingleTierMachine.TestCase


def test_policies_copy_cleanly() -> None:
    # insert_many must not leave state a deepcopy-based default would miss.
    p = ARCPolicy(3)
    p.insert_many([K(1), K(2)])
    q = copy.deepcopy(p)
    assert q.state() == p.state()


def test_targets_are_judged_from_the_measurements() -> None:
    from tiercache.benchharness.replay import CacheRun
    from tiercache.benchharness.runner import BenchReport, CacheRow, CurvePoint, SpeedRow

    r = BenchReport("m", "now", BenchOptions())
    r.traces = [{"name": "chat", "requests": 1, "blocks": 1, "unique_blocks": 1}]
    r.speed = [
        SpeedRow("chat", "tiercache arc", 10, 3.0e6, 0.5, 3),
        SpeedRow("chat", "vllm arc", 10, 1.0e6, 0.5, 3),
    ]
    r.curves = [
        CurvePoint("chat", 0.1, 10, {"tiercache arc": 0.5, "vllm arc": 0.5, "belady": 0.6}),
        CurvePoint("chat", 0.2, 20, {"tiercache arc": 0.6, "vllm arc": 0.61, "belady": 0.7}),
    ]
    r.cache = [CacheRow(CacheRun("chat", 100, 94, 1.0, 16), 30, 1.0, 1e9)]
    (speed, t), (hits, h), (belady_t, b) = [(x[2], x[1]) for x in r.targets()]
    # 3x vLLM meets 2.5x; one curve point below vLLM misses; 0.94 of Belady misses 5%.
    assert speed and t == "3.00x"
    assert not hits and h.startswith("1/2 points") and "chat@20% 0.6000<0.6100" in h
    assert not belady_t and b == "0.940 of Belady"


def test_a_point_below_target_shows_enough_digits_to_differ() -> None:
    from tiercache.benchharness.runner import _apart

    assert _apart(0.935861, 0.935889, "<") == "0.93586<0.93589"  # 4 decimals: 0.9359<0.9359
    assert _apart(0.4741, 0.4752, "<") == "0.4741<0.4752"
