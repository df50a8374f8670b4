"""`StoreProbe.present`, the question the shared-blocks sweep asks (issue 51): one flag per
key, the test `probe` makes, asked of every key at once. The same suite runs on every kind
of store a sweep asks (a real LMDB environment, real NVMe files, a real redis-server), each
through the tier and through the read-only probe a scheduler opens: `present` answers what
`probe` asked per key answers, for blocks held, blocks absent, another namespace's equal
key and a malformed header (Redis excepted there: its EXISTS reads no header, so that a
sweep leaves LRU/LFU alone). LMDB answers in one read transaction; an unreachable Redis,
or a closed store, answers None (nothing is known gone)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.campaign_support import blocks, key
from tiercache import TierCache
from tiercache.config import CacheConfig
from tiercache.connectors.probes import open_probes
from tiercache.tiers import tier_class
from tiercache.tiers.base import StoreProbe, Tier
from tiercache.tiers.format import namespace_id
from tiercache.tiers.lmdb import layout
from tiercache.tiers.nvme import NVMeTier
from tiercache.tiers.nvme.layout import SLAB
from tiercache.tiers.nvme.reader import NVMeStoreReader
from tiercache.tiers.nvme.siblings import NVMeSiblingsTier, SiblingsProbe

BB, NS, OTHER = 256, "present", "another tenant"
OURS = [0, 1, 2, 3, 4]  # stored in our namespace
MALFORMED = 3  # of OURS, its header damaged after the fill
# Asked out of order, with repeats: `present` is no leading run.
ASK = [key(i) for i in (5, 0, 7, 1, MALFORMED, 2, 6, 4, 0)]


def expected(malformed_held: bool) -> list[bool]:
    held = set(OURS) - ({MALFORMED} if not malformed_held else set())
    return [int.from_bytes(k, "big") in held for k in ASK]


def _config(tier: dict[str, Any], namespace: str = NS) -> CacheConfig:
    return CacheConfig.from_mapping({"namespace": namespace, "tiers": [tier]})


def _fill(tier: dict[str, Any], namespace: str, ids: list[int]) -> None:
    with TierCache.open({"namespace": namespace, "tiers": [tier]}, block_bytes=BB) as cache:
        assert cache.put([key(i) for i in ids], blocks(ids, BB)) == len(ids)


class PresentConformance:
    """What every kind of store answers. Subclasses fill a store (`OURS` in `NS`, `theirs`
    in `OTHER`, `MALFORMED`'s header damaged) and open what is asked of it (`open`)."""

    malformed_held = False  # Redis: True (see `RedisTier.present`)
    theirs = [0, 7]  # stored in another namespace: 7 only there

    def open(self, tmp_path: Path) -> list[StoreProbe]:
        raise NotImplementedError

    @pytest.fixture
    def probes(self, tmp_path: Path) -> Iterator[list[StoreProbe]]:
        probes = self.open(tmp_path)
        yield probes
        for p in probes:
            p.close()

    def test_present_answers_what_probe_asked_per_key_answers(
        self, probes: list[StoreProbe]
    ) -> None:
        for p in probes:
            got = p.present(ASK)
            per_key = [p.probe([k]) == 1 for k in ASK]
            assert got == expected(self.malformed_held), type(p).__name__
            assert per_key == expected(False), type(p).__name__
            assert p.present(ASK) == got  # asking changed nothing (a dropped entry stays gone)

    def test_no_keys_no_flags(self, probes: list[StoreProbe]) -> None:
        for p in probes:
            assert p.present([]) == []

    def test_a_block_the_tier_is_deleting_reads_as_gone(self, probes: list[StoreProbe]) -> None:
        tier = probes[0]
        assert isinstance(tier, Tier)
        k = key(9)
        slots = tier.allocate([k])
        assert slots is not None
        if tier.read_only:  # it stores nothing, so it deletes nothing: its write refuses
            with pytest.raises(OSError, match="read-only"):
                tier.write(slots, blocks([9], BB), [k])
            assert tier.present([k, key(0)]) == [False, True]
            return
        tier.write(slots, blocks([9], BB), [k])
        assert tier.present([k]) == [True] and tier.probe([k]) == 1
        tier.free(slots)  # deleted from the store at the next write or flush
        assert tier.present([k, key(0)]) == [False, True]
        assert tier.probe([k]) == 0


class TestLMDB(PresentConformance):
    def open(self, tmp_path: Path) -> list[StoreProbe]:
        lmdb_cfg = {"kind": "lmdb", "blocks": 16, "path": str(tmp_path / "store")}
        _fill(lmdb_cfg, NS, OURS)
        _fill(lmdb_cfg, OTHER, self.theirs)
        env = lmdb.open(str(tmp_path / "store"), max_dbs=4, mode=0o600)
        try:  # a damaged header the lazy open does not scan
            heads = env.open_db(layout.HEADS_DB, create=False)
            sk = namespace_id(NS).to_bytes(layout.NS_BYTES, "big") + key(MALFORMED)
            with env.begin(write=True, db=heads) as txn:
                head = bytearray(txn.get(sk))
                head[8] ^= 1  # the key the header names
                txn.put(sk, bytes(head))
        finally:
            env.close()
        cfg = _config(lmdb_cfg).tiers[0]
        tier = tier_class("lmdb").from_config(cfg, BB, namespace=NS)  # lazy, as in a cache
        ((_, probe),) = open_probes(_config(lmdb_cfg), BB)  # borrows the tier's environment
        return [tier, probe]

    def test_one_read_transaction_per_question(self, probes: list[StoreProbe]) -> None:
        """Per key, `probe` begins a read transaction each; `present` one for them all."""
        tier, probe = probes
        shared = tier._shared  # type: ignore[attr-defined]
        probe.probe([key(0)])  # opened
        handle = probe._handle  # type: ignore[attr-defined]
        for owner in (shared, handle):
            counted = _Counting(owner.env)
            object.__setattr__(owner, "env", counted)
            try:
                p = tier if owner is shared else probe
                assert [p.probe([k]) for k in ASK] and counted.begun == len(ASK)
                counted.begun = 0
                assert p.present(ASK) == expected(False) and counted.begun == 1
            finally:
                object.__setattr__(owner, "env", counted.env)

    def test_a_closed_store_answers_none(self, probes: list[StoreProbe]) -> None:
        for p in probes:
            p.close()
            assert p.present(ASK) is None  # nothing is known gone
            assert p.probe(ASK) == 0


class _Counting:
    """An LMDB environment that counts the transactions begun on it."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env, self.begun = env, 0

    def begin(self, *args: Any, **kwargs: Any) -> lmdb.Transaction:
        self.begun += 1
        return self.env.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


class TestNVMe(PresentConformance):
    # Another namespace's instance (1, after ours in the siblings' index: its entries the
    # newer) holds an equal key 0, and 7 only there.
    def open(self, tmp_path: Path) -> list[StoreProbe]:
        for ns, instance, ids in ((NS, 0, OURS), (OTHER, 1, self.theirs)):
            t = NVMeTier(
                block_bytes=BB, capacity_blocks=16, path=tmp_path, namespace=ns, instance=instance
            )
            try:
                keys = [key(i) for i in ids]
                slots = t.allocate(keys)
                assert slots is not None
                t.write(slots, blocks(ids, BB), keys)
                t.flush()
                at = dict(zip(ids, slots, strict=True))
            finally:
                t.close()
            if ns == NS:
                reader = NVMeStoreReader(tmp_path)
                slot_bytes = reader.slot_bytes
                reader.close()
                with open(tmp_path / SLAB, "r+b") as f:  # the key the header names
                    f.seek(at[MALFORMED] * slot_bytes + 8)
                    b = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([b[0] ^ 1]))
        tier: Tier = NVMeSiblingsTier(block_bytes=BB, path=str(tmp_path), namespace=NS)
        return [tier, SiblingsProbe(str(tmp_path), BB, NS)]


class TestRedis(PresentConformance):
    malformed_held = True  # EXISTS, which reads no header and leaves LRU/LFU alone

    @pytest.fixture(autouse=True)
    def _server(self) -> Iterator[None]:
        from tests.test_tier_redis import RedisServer, require_redis

        require_redis()  # a skip where redis-server is missing; under CI=true a failure
        d = Path(tempfile.mkdtemp(prefix="tc-present-"))
        self.srv = RedisServer(d, "--appendonly", "no")
        yield
        self.srv.kill()
        shutil.rmtree(d, ignore_errors=True)

    def open(self, tmp_path: Path) -> list[StoreProbe]:
        redis_cfg = {
            "kind": "redis",
            "url": self.srv.url,
            "blocks": 16,
            "prefix": "tc-present:",
            "timeout": 0.3,
        }
        _fill(redis_cfg, NS, OURS)
        _fill(redis_cfg, OTHER, self.theirs)
        r = self.srv.client()
        try:  # the key the header names, damaged
            rkey = b"tc-present:" + NS.encode() + key(MALFORMED)
            head = r.getrange(rkey, 8, 8)
            r.setrange(rkey, 8, bytes([head[0] ^ 1]))
        finally:
            r.close()
        cfg = _config(redis_cfg).tiers[0]
        tier = tier_class("redis").from_config(cfg, BB, namespace=NS)
        ((_, probe),) = open_probes(_config(redis_cfg), BB)
        return [tier, probe]

    def test_an_unreachable_server_answers_none(self, probes: list[StoreProbe]) -> None:
        self.srv.kill()
        for p in probes:
            assert p.present(ASK) is None  # nothing is known gone
            assert p.probe(ASK) == 0
