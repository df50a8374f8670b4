"""Read-only NVMe siblings (tiers/nvme/siblings.py): a rank reads the other instances of its
NVMe path, never writing into them, and a sibling slot its owner reused since its journal
was read is a plain miss. Real NVMe files in tmp dirs, real tensors, the facade and the
transfer engine's disk handler (the KV connector's worker path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.campaign_support import blocks, key, load_on_this_thread
from tiercache import TierCache
from tiercache.connectors.probes import open_probes
from tiercache.connectors.ranks import resolve_rank_config, with_nvme_siblings
from tiercache.tiers.nvme import NVMeTier
from tiercache.tiers.nvme.siblings import NVMeSiblingsTier, SiblingsProbe

BB, NS = 4096, "sib"


def _config(path: Path, instance: int, *, cpu: int = 4, namespace: str = NS) -> dict:
    """A rank's config as the KV connector resolves it under head shards: CPU, its own NVMe
    instance, and the siblings right below."""
    nvme = {"kind": "nvme", "path": str(path), "blocks": 16, "instance": instance}
    return with_nvme_siblings(
        {"block_size": 4, "namespace": namespace, "tiers": [{"kind": "cpu", "blocks": cpu}, nvme]}
    )


def _store(
    path: Path, instance: int, ids: range, *, namespace: str = NS, payloads: range | None = None
) -> None:
    """What another rank layout wrote: blocks `ids` in NVMe instance `instance`, closed (the
    bytes of `payloads`' ids, default `ids`' own)."""
    c = TierCache.open(_config(path, instance, namespace=namespace), block_bytes=BB)
    try:
        assert c.put([key(i) for i in ids], blocks(payloads or ids, BB)) == len(ids)
    finally:
        c.close()


def _reuse_slot(path: Path, i: int) -> None:
    """Instance 0's owner frees block i's slot and writes another block (key 99) into it."""
    owner = NVMeTier(block_bytes=BB, capacity_blocks=16, path=path, namespace=NS, instance=0)
    try:
        slot = dict(owner.recover())[key(i)]
        owner.free([slot])
        owner.write([slot], blocks([99], BB), [key(99)])
        owner.flush()
    finally:
        owner.close()


def _files(d: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of one instance directory (not its sub-instances): bytes and mtime."""
    return {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.iterdir()) if p.is_file()
    }


def _healthy(cache: TierCache) -> None:
    for medium, st in cache.stats().items():
        assert st["errors"] == 0, (medium, st)
        assert st.get("suspensions", 0) == 0, (medium, st)


def test_the_siblings_tier_follows_each_nvme_tier_under_head_shards(tmp_path: Path) -> None:
    user = {
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {"kind": "nvme", "path": str(tmp_path), "blocks": 8},
        ]
    }
    shared = resolve_rank_config(
        user,
        block_size=4,
        key_namespace="k",
        store_namespace="k",
        tp_rank=1,
        tp_size=2,
        shared=True,
    )
    kinds = [(t.kind, t.name, t.options.get("instance")) for t in shared.config.tiers]
    assert kinds == [
        ("cpu", "cpu", None),
        ("nvme", "nvme", 1),
        ("nvme-siblings", "nvme-siblings", 1),  # its own instance: not read
    ]
    assert shared.config.write_through == [False, True, False]  # never written through
    per_rank = resolve_rank_config(
        user, block_size=4, key_namespace="k", store_namespace="k", tp_rank=1, tp_size=2
    )
    assert [t.kind for t in per_rank.config.tiers] == ["cpu", "nvme"]  # per-rank paths: none


@pytest.mark.parametrize(("writer", "reader"), [(0, 1), (1, 0)])
def test_a_rank_loads_what_another_instance_holds_and_writes_nothing_there(
    tmp_path: Path, writer: int, reader: int
) -> None:
    """TP 1 -> 2 (rank 1 reads instance 0) and TP 2 -> 1 (rank 0 reads instance 1)."""
    ids = range(10)
    _store(tmp_path, writer, ids)
    d = tmp_path if writer == 0 else tmp_path / f"instance{writer}"
    before = _files(d)
    c = TierCache.open(_config(tmp_path, reader, cpu=16), block_bytes=BB)
    try:
        sib = c.tiers[2]
        assert isinstance(sib, NVMeSiblingsTier) and sib.siblings == [writer]
        keys = [key(i) for i in ids]
        assert c.lookup(keys) == len(ids)
        assert torch.equal(c.get(keys), blocks(ids, BB))
        st = c.stats()
        assert st["nvme-siblings"]["discovered"] == len(ids)
        _healthy(c)
        # A block loaded from a sibling is the rank's to keep: promoted into its CPU tier.
        assert st["cpu"]["used_blocks"] == len(ids)
    finally:
        c.close()  # writes back what the CPU tier holds: into the rank's own instance only
    assert _files(d) == before  # nothing written into the sibling, not even its journal
    own = tmp_path if reader == 0 else tmp_path / f"instance{reader}"
    c = TierCache.open(_config(tmp_path, reader, cpu=1), block_bytes=BB)
    try:
        assert c.tiers[1].used_blocks > 0 and Path(c.tiers[1].path) == own
    finally:
        c.close()


def test_a_sibling_slot_reused_by_its_owner_is_a_plain_miss(tmp_path: Path) -> None:
    """The reader indexes sibling blocks (its journal read at open, a lookup adopts them);
    then the owner frees one slot and writes another block into it. The read finds another
    key in the slot: a miss, the chain ends there, no error, no suspension."""
    _store(tmp_path, 0, range(4))
    c = TierCache.open(_config(tmp_path, 1, cpu=1), block_bytes=BB)
    try:
        keys = [key(i) for i in range(4)]
        assert c.lookup(keys, count=False) == 4  # adopted from instance 0
        _reuse_slot(tmp_path, 2)
        got = c.get(keys, count=False)
        assert torch.equal(got, blocks(range(2), BB))  # served up to the reused slot
        _healthy(c)
        assert c.lookup([key(2)], count=False) == 0  # dropped, and not found again
        _healthy(c)
    finally:
        c.close()


def test_the_disk_handler_reports_a_reused_sibling_slot_as_gone(tmp_path: Path) -> None:
    """The worker's path: the transfer engine reads the sibling on its own threads and sorts
    the failure there: gone (a plain miss), not an error."""
    _store(tmp_path, 0, range(3))
    c = TierCache.open(_config(tmp_path, 1), block_bytes=BB)
    try:
        keys = (key(0), key(1), key(2))
        with c.lock:
            assert c.manager.lookup(keys, count=False) == 3
            spec = c.manager.prepare_load(keys)
        assert spec.tiers == (2, 2, 2)
        _reuse_slot(tmp_path, 1)
        cpu = c.tiers[0]
        r = load_on_this_thread(c, 2, spec.slots, keys, (0, 1, 2))
        assert not r.success and r.failed == (1,) and r.gone == (1,)
        assert torch.equal(cpu.pool[0], blocks([0], BB)[0])
        assert torch.equal(cpu.pool[2], blocks([2], BB)[0])
    finally:
        c.close()


def test_the_scheduler_probe_sees_every_instance_and_checks_headers(tmp_path: Path) -> None:
    _store(tmp_path, 0, range(0, 3))
    _store(tmp_path, 1, range(3, 6))
    cfg = TierCache.open(_config(tmp_path, 2), block_bytes=BB)
    try:
        probes = open_probes(cfg.config, BB)
    finally:
        cfg.close()
    assert [m for m, _ in probes] == ["nvme-siblings"]
    probe = probes[0][1]
    try:
        assert isinstance(probe, SiblingsProbe)
        assert probe.probe([key(i) for i in range(6)]) == 6  # across instances 0 and 1
        assert probe.probe([key(0), key(7)]) == 1
        other = SiblingsProbe(str(tmp_path), BB, "another namespace")
        assert other.probe([key(0)]) == 0  # headers name the namespace
        other.close()
    finally:
        probe.close()


# Two tenants (namespaces) of one NVMe path storing an equal key: NVMe journal entries name no
# namespace, so the siblings' index holds both places of the key, and each tenant must find
# its own copy whichever was written last, in two instances or in one.
TENANTS = {NS: range(100, 104), "another tenant": range(200, 204)}  # namespace -> payload ids


@pytest.mark.parametrize("last", list(TENANTS))
@pytest.mark.parametrize("instances", [(0, 1), (0, 0)], ids=["two-instances", "one-instance"])
def test_tenants_with_an_equal_key_each_find_their_own_copy(
    tmp_path: Path, last: str, instances: tuple[int, int]
) -> None:
    """`last` wrote after the other tenant, into `instances[1]` (the other: `instances[0]`);
    its entries are then the newer in the siblings' index. The other tenant last is NS's
    unlucky order: its index kept only that tenant's place, and NS found nothing."""
    ids = range(4)
    keys = [key(i) for i in ids]
    order = sorted(TENANTS, key=lambda ns: ns == last)  # the other tenant first, `last` last
    for ns, instance in zip(order, instances, strict=True):
        _store(tmp_path, instance, ids, namespace=ns, payloads=TENANTS[ns])
    for ns, payloads in TENANTS.items():
        # 1. The scheduler's probe finds every key, per key too, for either tenant.
        probe = SiblingsProbe(str(tmp_path), BB, ns)
        try:
            assert probe.probe(keys) == len(keys), ns
            assert probe.present(keys) == [True] * len(keys), ns
        finally:
            probe.close()
        # 2. A rank of the tenant (its own instance 2) loads its own bytes, verified on read,
        # never the other tenant's (whose header would fail the check: a miss).
        c = TierCache.open(_config(tmp_path, 2, cpu=16, namespace=ns), block_bytes=BB)
        try:
            assert c.lookup(keys) == len(keys), ns
            assert torch.equal(c.get(keys), blocks(payloads, BB)), ns
            assert c.stats()["nvme-siblings"]["discovered"] == len(keys)
            _healthy(c)
        finally:
            c.close()
        # 3. The tier itself: probe, adopt, and a verified read into a tensor.
        t = NVMeSiblingsTier(block_bytes=BB, path=str(tmp_path), namespace=ns, instance=2)
        try:
            assert t.probe(keys) == len(keys)
            slots = t.adopt(keys)
            assert slots is not None
            out = torch.zeros((len(keys), BB), dtype=torch.uint8)
            assert t.read(slots, out, keys) == [] and torch.equal(out, blocks(payloads, BB))
            assert t.take_gone(keys) == set()
        finally:
            t.close()
    # A third namespace holds none of them.
    other = SiblingsProbe(str(tmp_path), BB, "a third tenant")
    try:
        assert other.probe(keys) == 0 and other.present(keys) == [False] * len(keys)
    finally:
        other.close()


def test_a_siblings_tier_refuses_writes(tmp_path: Path) -> None:
    _store(tmp_path, 0, range(1))
    t = NVMeSiblingsTier(block_bytes=BB, path=str(tmp_path), namespace=NS)
    try:
        assert t.siblings == [0] and t.read_only
        with pytest.raises(OSError, match="read-only"):
            t.write([0], blocks([0], BB), [key(0)])
        assert os.path.exists(tmp_path / "slab")
    finally:
        t.close()


def test_the_siblings_index_keeps_keys_ending_in_zero_bytes() -> None:
    """Numpy's fixed-width bytes drop trailing zero bytes; the index must not confuse keys
    that differ only there, and a newer entry of a key wins (`get`; `places` keeps every
    place, newest first)."""
    from tiercache.tiers.nvme.siblings import _Index

    a, b = b"k" + bytes(15), b"k" + bytes(14) + b"\x01"
    idx = _Index([a, b, a], [(1 << 40) | 5, 7, 9])
    assert idx.get(a) == (0, 9) and idx.get(b) == (0, 7)
    assert idx.places(a) == [(0, 9), (1, 5)] and idx.places(b) == [(0, 7)]
    assert idx.get(b"k") is None and idx.get(bytes(16)) is None and len(idx) == 2
    assert _Index([], []).get(a) is None
