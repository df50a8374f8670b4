"""The public facade `TierCache` exactly as the issue writes it, on real tensors; plus a
hypothesis state machine: whatever `get` returns is byte-identical to what was `put`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiercache import CacheConfig, OffloadingEvent, TierCache
from tiercache.workload import block_bytes_for

N = 256


def cfg(*caps: int, policy: str = "lru", **top) -> dict:
    tiers = [{"kind": "cpu", "blocks": caps[0], "policy": policy}]
    tiers += [
        {"kind": "gpu", "device": "cpu", "name": f"low{i}", "blocks": c, "policy": policy}
        for i, c in enumerate(caps[1:])
    ]
    return {"block_size": 4, "namespace": "test/model/bf16/tp1/0", "tiers": tiers, **top}


def toks(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


def test_public_api_round_trip() -> None:
    with TierCache.open(cfg(64), block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(41))
        assert len(keys) == 10 and all(len(k) == 16 for k in keys)  # 41 // 4 full blocks
        blocks = block_bytes_for(keys, N)
        assert cache.put(keys, blocks) == 10
        assert cache.lookup(keys) == 10
        got = cache.get(keys)
        assert got.dtype == torch.uint8 and got.shape == (10, N) and torch.equal(got, blocks)
        events = cache.take_events()
        assert all(isinstance(e, OffloadingEvent) for e in events)
        assert [(e.medium, e.removed) for e in events] == [("cpu", False)]
        assert events[0].keys == tuple(keys)
        s = cache.stats()["cpu"]
        for field in ("capacity_blocks", "used_blocks", "hits", "misses", "evictions", "errors"):
            assert field in s
        assert (s["capacity_blocks"], s["used_blocks"]) == (64, 10)
        assert cache.manager.lookup(keys) == 10


def test_open_from_toml_and_config(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        'block_size = 16\nnamespace = "m/bf16/tp1/0"\n'
        '[[tiers]]\nkind = "cpu"\ncapacity = "1MiB"\npolicy = "arc"\n'
    )
    with TierCache.open(p, block_bytes=4096) as c1:
        assert c1.stats()["cpu"]["capacity_blocks"] == 256
    with (
        TierCache.open(str(p), block_bytes=4096) as c2,
        TierCache.open(CacheConfig.from_toml(p), block_bytes=4096) as c3,
    ):
        assert c2.config == c3.config


def test_partial_hits_and_prefix_semantics() -> None:
    with TierCache.open(cfg(64), block_bytes=N) as cache:
        t = toks(40)
        keys = cache.hash_tokens(t)
        cache.put(keys[:4], block_bytes_for(keys[:4], N))
        assert cache.lookup(keys) == 4
        assert cache.get(keys).shape == (4, N)
        other = cache.hash_tokens(t[:8] + toks(32, 1))
        assert cache.lookup(other) == 2  # shares the first two blocks only
        # put of the whole chain stores only the 6 missing blocks and reports all 10 held.
        assert cache.put(keys, block_bytes_for(keys, N)) == 10
        assert cache.stats()["cpu"]["stored"] == 10


def test_bad_blocks_raise_and_change_nothing() -> None:
    with TierCache.open(cfg(16), block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(8))
        good = block_bytes_for(keys, N)
        cache.put(keys[:1], good[:1])
        cases = [
            (TypeError, good.to(torch.int16)),
            (ValueError, good[:, :-1].contiguous()),
            (ValueError, torch.zeros((3, N), dtype=torch.uint8)),
            (ValueError, torch.zeros((2, N), dtype=torch.uint8, device="meta")),
            (ValueError, torch.zeros((N, 2), dtype=torch.uint8).t()),
            (TypeError, good.numpy()),
        ]
        for exc, bad in cases:
            with pytest.raises(exc):
                cache.put(keys, bad)
        assert cache.lookup(keys) == 1 and cache.stats()["cpu"]["used_blocks"] == 1
        assert torch.equal(cache.get(keys), good[:1])


@pytest.mark.parametrize(
    "keys,exc,msg",
    [
        ([], ValueError, "empty"),
        ([b"short"], ValueError, "16-byte"),
        (["a" * 16], TypeError, "bytes"),
        ([b"k" * 16, b"k" * 16], ValueError, "duplicate"),
        (b"k" * 16, TypeError, "sequence"),
    ],
)
def test_bad_keys(keys, exc, msg) -> None:
    with TierCache.open(cfg(4), block_bytes=N) as cache:
        for call in (cache.lookup, cache.get):
            with pytest.raises(exc, match=msg):
                call(keys)


def test_demotion_keeps_bytes_and_promotion_brings_them_back() -> None:
    with TierCache.open(cfg(4, 16), block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(48))  # 12 blocks through a 4-block first tier
        blocks = block_bytes_for(keys, N)
        for i in range(0, 12, 4):
            cache.put(keys[i : i + 4], blocks[i : i + 4])
        s = cache.stats()
        assert s["cpu"]["used_blocks"] == 4 and s["low0"]["used_blocks"] == 8
        assert cache.lookup(keys) == 12
        assert torch.equal(cache.get(keys[:4]), blocks[:4])  # served from low0 ...
        # ... and promoted into the first tier (the copy below stays).
        assert all(cache.manager.where(k)[0] == 0 for k in keys[:4])
        assert torch.equal(cache.get(keys), blocks)


def test_three_tiers_lose_nothing_while_total_capacity_suffices() -> None:
    with TierCache.open(cfg(4, 5, 40, policy="arc", promote=False), block_bytes=N) as cache:
        chains = [cache.hash_tokens(toks(16, s)) for s in range(10)]  # 40 blocks in all
        for c in chains:
            cache.put(c, block_bytes_for(c, N))
        for c in chains:
            assert torch.equal(cache.get(c), block_bytes_for(c, N))


def test_context_manager_and_closed() -> None:
    cache = TierCache.open(cfg(4), block_bytes=N)
    with cache:
        pass
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.lookup([b"k" * 16])


def _spy_closes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each CPU, NVMe and LMDB tier's `close`, by kind, in call order."""
    from tiercache.tiers.cpu import CPUTier
    from tiercache.tiers.lmdb import LMDBTier
    from tiercache.tiers.nvme import NVMeTier

    closed: list[str] = []
    for cls in (CPUTier, NVMeTier, LMDBTier):
        real = cls.close

        def close(self, _real=real) -> None:  # type: ignore[no-untyped-def]
            closed.append(self.kind)
            _real(self)

        monkeypatch.setattr(cls, "close", close)
    return closed


def test_open_is_all_or_nothing(tmp_path, monkeypatch) -> None:
    closed = _spy_closes(monkeypatch)
    good = {
        "namespace": "all-or-nothing",
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {"kind": "nvme", "blocks": 4, "path": str(tmp_path / "nvme")},
            {"kind": "lmdb", "blocks": 4, "path": str(tmp_path / "lmdb")},
        ],
    }
    bad = {**good, "tiers": [*good["tiers"], {"kind": "gpu", "blocks": 4, "device": "cuda:99"}]}
    with pytest.raises(Exception, match=r"cuda:99|CUDA"):
        TierCache.open(bad, block_bytes=N)
    # The three tiers opened before the failing one were closed, last opened first ...
    assert closed == ["lmdb", "nvme", "cpu"]
    # ... so the NVMe store's exclusive lock was released: the same path opens again (a
    # leaked tier would hold it: "all 1 instances are in use").
    closed.clear()
    with TierCache.open(good, block_bytes=N) as cache:
        assert [t.kind for t in cache.tiers] == ["cpu", "nvme", "lmdb"]
    assert sorted(closed) == ["cpu", "lmdb", "nvme"]
    # A failure after every tier is built (the facade's own construction) closes them too.
    closed.clear()

    def broken_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("facade construction failed")

    monkeypatch.setattr(TierCache, "__init__", broken_init)
    with pytest.raises(RuntimeError, match="facade construction failed"):
        TierCache.open(good, block_bytes=N)
    assert closed == ["lmdb", "nvme", "cpu"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="block_bytes"):
        TierCache.open(cfg(4), block_bytes=0)
    with pytest.raises(ValueError, match=r"tiers\[0\].capacity"):
        TierCache.open({"tiers": [{"kind": "cpu", "capacity": "100B"}]}, block_bytes=N)


def test_get_into_caller_buffer() -> None:
    with TierCache.open(cfg(8), block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(16))
        cache.put(keys[:2], block_bytes_for(keys[:2], N))
        buf = torch.zeros((4, N), dtype=torch.uint8)
        got = cache.get(keys, out=buf)
        assert got.shape == (2, N) and got.data_ptr() == buf.data_ptr()
        assert torch.equal(buf[:2], block_bytes_for(keys[:2], N)) and not buf[2:].any()


class CacheMachine(RuleBasedStateMachine):
    """Never wrong bytes: `get` returns exactly what `put` stored for each returned key, and
    `lookup` agrees with `get`."""

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        caps=st.sampled_from([(2,), (3, 2), (2, 3, 4), (5, 1)]),
        promote=st.booleans(),
    )
    def start(self, policy: str, caps, promote: bool) -> None:
        self.cache = TierCache.open(cfg(*caps, policy=policy, promote=promote), block_bytes=40)
        self.truth: dict[bytes, bytes] = {}

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()

    @rule(seed=st.integers(0, 5), n=st.integers(1, 4), salt=st.integers(0, 255))
    def put(self, seed: int, n: int, salt: int) -> None:
        keys = self.cache.hash_tokens(toks(4 * n, seed))
        blocks = torch.randint(0, 256, (n, 40), dtype=torch.uint8)
        before = {k for k in keys if self.cache.manager.where(k)}
        held = self.cache.put(keys, blocks)
        assert 0 <= held <= n
        for k, row in zip(keys, blocks, strict=True):
            # Keys held before the put are not rewritten; newly held ones carry the new bytes.
            if k not in before and self.cache.manager.where(k):
                self.truth[k] = row.numpy().tobytes()

    @rule(seed=st.integers(0, 5), n=st.integers(1, 4))
    def get(self, seed: int, n: int) -> None:
        keys = self.cache.hash_tokens(toks(4 * n, seed))
        k = self.cache.lookup(keys)
        got = self.cache.get(keys)
        assert got.shape[0] == k
        for key, row in zip(keys, got, strict=False):
            assert row.numpy().tobytes() == self.truth[key]

    @invariant()
    def capacity(self) -> None:
        if hasattr(self, "cache"):
            for s in self.cache.stats().values():
                assert s["used_blocks"] <= s["capacity_blocks"]


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


def test_chain_longer_than_first_tier_keeps_its_head() -> None:
    with TierCache.open(cfg(4), block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(40))
        assert cache.put(keys, block_bytes_for(keys, N)) == 4
        assert cache.lookup(keys) == 4


def test_demotion_never_copies_a_row_that_failed_to_read(tmp_path) -> None:
    """A block whose source read fails during demotion is dropped, not written below as garbage
    (on a persistent tier a garbage record would come back after a restart)."""
    config = {
        "block_size": 4,
        "namespace": "test/model/bf16/tp1/0",
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            # write-back: the test follows a demotion (no write-through copy beside it)
            {
                "kind": "nvme",
                "blocks": 16,
                "path": str(tmp_path / "nvme"),
                "write_policy": "write-back",
            },
        ],
    }
    with TierCache.open(config, block_bytes=N) as cache:
        keys = cache.hash_tokens(toks(32))  # 8 blocks
        blocks = block_bytes_for(keys, N)
        cache.put(keys[:4], blocks[:4])
        top = cache.tiers[0]
        real_read = top.read
        bad_key = keys[1]

        def flaky_read(slots, out, ks):
            failed = list(real_read(slots, out, ks))
            for i, k in enumerate(ks):
                if k == bad_key:
                    out[i].fill_(0xEE)
                    failed.append(i)
            return sorted(set(failed))

        top.read = flaky_read  # type: ignore[method-assign]
        cache.put(keys[4:], blocks[4:])  # demotes keys[:4] into nvme
        top.read = real_read  # type: ignore[method-assign]
        assert cache.manager.where(bad_key) == []
        assert cache.stats()["cpu"]["errors"] >= 1
        assert all(cache.manager.where(keys[i]) for i in (0, 2, 3))
        assert cache.lookup(keys[:4]) == 1  # the chain breaks at the dropped block
    with TierCache.open(config, block_bytes=N) as cache:  # after a restart: still not there
        assert cache.manager.where(bad_key) == []
        assert torch.equal(cache.get(keys[:1]), blocks[:1])


_EXIT_CHILD = """
import json, sys
from tiercache import TierCache
from tiercache.workload import block_bytes_for
config = json.loads(sys.argv[1])
cache = TierCache.open(config, block_bytes=256)
keys = cache.hash_tokens(list(range(32)))
cache.put(keys, block_bytes_for(keys, 256))  # lands in the volatile cpu tier only
print(json.dumps([k.hex() for k in keys]))
# no close(): the exit hook must write the blocks back to the NVMe tier
"""


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_clean_exit_without_close_writes_back(tmp_path, kind) -> None:
    """A process that exits without closing its cache still finds its blocks on disk at the
    next start: the exit hook runs while the disk tier's thread pool still takes work."""
    import json
    import subprocess
    import sys

    config = {
        "block_size": 4,
        "namespace": "test/model/bf16/tp1/0",
        "tiers": [
            {"kind": "cpu", "blocks": 16},
            {"kind": kind, "blocks": 16, "path": str(tmp_path / kind)},
        ],
    }
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "failed" not in run.stderr, run.stderr
    keys = [bytes.fromhex(h) for h in json.loads(run.stdout)]
    with TierCache.open(config, block_bytes=N) as cache:
        assert cache.lookup(keys) == len(keys) == 8
        assert all(cache.manager.where(k) == [1] for k in keys)  # on disk only
        assert torch.equal(cache.get(keys), block_bytes_for(keys, N))
