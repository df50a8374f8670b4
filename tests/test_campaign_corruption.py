"""Corruption campaign: seeded mutations of stored caches (flipped bytes, zeroed pages,
truncated files, deleted index files) on the NVMe and LMDB tiers, each round checked through
a `TierCache` opened in a fresh process: every mutated block is a miss and is counted (at
open in the tier's `open_report`, or at read in the cache's `errors`), every untouched block
reads back exact, nothing is served with other bytes, and the cache keeps storing and serving.
Plus hypothesis fuzz targets for the on-disk header (`tiers/format.py`), the NVMe index
journal and metadata, and the LMDB metadata parser.

What is mutated and how it is judged:
- NVMe slab bytes (a block's header or payload, its padding, free slots): a block is mutated
  when the bytes of its header + payload changed; it must be dropped at open (`blocks_dropped`)
  or fail its checksum at read (`errors`): exactly one count per such block.
- NVMe index journal: a block whose PUT record changed is lost and counted in
  `records_skipped`; records cut off whole by a truncation are indistinguishable from a
  crash before they were written (forgotten: misses, reported as `forgotten`); a deleted
  journal forgets everything and sets `index_missing`. A deleted meta.json loses nothing.
- LMDB values and headers (located in data.mdb from the stored bytes), zeroed payload pages,
  a deleted lock.mdb: judged like NVMe data. Random flips anywhere in data.mdb and truncated
  data files can hit LMDB's own tree pages, which carry no checksum: the store then either
  opens and serves no wrong byte, or is refused with a ConfigError naming the damage.

Bounded here (TIERCACHE_CORRUPTION_MUTATIONS, default 120 per tier); `-m stress`: 1,200 per tier.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.campaign_children import probe_cache
from tests.campaign_support import blocks, key, lmdb_entries, open_tier, report, run_child, scale
from tiercache import TierCache
from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers import format as fmt
from tiercache.tiers.format import namespace_id
from tiercache.tiers.lmdb import env as lmdb_tier
from tiercache.tiers.lmdb import layout as lmdb_layout_mod
from tiercache.tiers.nvme import journal as nvme

N_BLOCKS = 24
BB = {"nvme": 12 * 1024, "lmdb": 16 * 1024}  # nvme: 16 KiB slots with 4,032 bytes of padding


def config(kind: str, path: Path) -> dict:
    tier = {"kind": kind, "blocks": 32, "path": str(path)}
    if kind == "nvme":
        tier["fsync"] = "batch"
    return {"namespace": "campaign", "tiers": [tier]}


def build_base(kind: str, path: Path) -> None:
    """24 blocks stored through a TierCache, in six puts of four; closed cleanly. An LMDB
    store is then compacted (`mdb_env_copy2` with MDB_CP_COMPACT), so data.mdb holds no stale
    copy-on-write pages and each header and value sits at exactly one offset."""
    built = path.with_name(path.name + "-built") if kind == "lmdb" else path
    with TierCache.open(config(kind, built), block_bytes=BB[kind]) as cache:
        for c in range(6):
            ids = list(range(4 * c, 4 * c + 4))
            assert cache.put([key(i) for i in ids], blocks(ids, BB[kind])) == 4
    if kind == "lmdb":
        path.mkdir(mode=0o700)
        env = lmdb.open(str(built), readonly=True, lock=False, max_dbs=3, subdir=True)
        try:
            env.copy(str(path), compact=True)
        finally:
            env.close()


def copy_store(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    os.chmod(dst, 0o700)


# -- locating blocks in the files -------------------------------------------------------------
def nvme_layout(store: Path) -> tuple[int, dict[int, int], dict[int, int]]:
    """(slot_bytes, block id -> slot, block id -> index of its PUT record in the journal)."""
    sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
    data = (store / "index").read_bytes()
    slot_of, record_of = {}, {}
    for r in range(len(data) // nvme.REC_SIZE):
        rec = nvme.parse_record(data, r * nvme.REC_SIZE)
        assert rec is not None
        op, slot, _seq, k = rec
        if op == nvme.OP_PUT:
            i = int.from_bytes(k, "big")
            slot_of[i], record_of[i] = slot, r
    assert len(slot_of) == N_BLOCKS
    return sb, slot_of, record_of


def lmdb_layout(store: Path) -> dict[int, list[tuple[int, int]]]:
    """Block id -> the (offset, length) ranges of its header and stored value in data.mdb."""
    entries = lmdb_entries(store)
    raw = (store / "data.mdb").read_bytes()
    out = {}
    for i, (h, v) in entries.items():
        ho, vo = raw.find(h), raw.find(v)
        assert ho >= 0 and vo >= 0 and raw.find(h, ho + 1) < 0
        out[i] = [(ho, len(h)), (vo, len(v))]
    assert len(out) == N_BLOCKS
    return out


PAGE = 4096
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08


def lmdb_tree_pages(store: Path) -> dict[int, set[int]]:
    """LMDB's own pages in data.mdb (meta, branch, leaf: they carry no checksum), page number
    -> the block ids with an entry on that page: a "heads" or "blocks" node under the block's
    store key, or an "order" node under its order seq. Value (overflow) pages are left out:
    damage there changes that block's own bytes."""
    raw = (store / "data.mdb").read_bytes()
    nsb = namespace_id("campaign").to_bytes(lmdb_layout_mod.NS_BYTES, "big")
    needles = {
        i: (nsb + key(i), nsb + lmdb_layout_mod.seq_bytes(lmdb_layout_mod.head_seq(h)))
        for i, (h, _) in lmdb_entries(store).items()
    }
    pages: dict[int, set[int]] = {}
    pg = 0
    while pg < len(raw) // PAGE:
        off = pg * PAGE
        flags = struct.unpack_from("<H", raw, off + 10)[0]
        if flags & P_OVERFLOW:  # a value's run of pages: its page count follows the flags
            pg += max(1, struct.unpack_from("<I", raw, off + 12)[0])
            continue
        if flags & (P_BRANCH | P_LEAF | P_META):
            page = raw[off : off + PAGE]
            pages[pg] = {i for i, ns in needles.items() if any(n in page for n in ns)}
        pg += 1
    return pages


def exposed_by_tree_damage(pages: dict[int, set[int]], old: bytes, new: bytes) -> set[int]:
    """The blocks a round's damage to LMDB's tree pages may cut off: those with an entry on
    a changed tree page; every block when a changed tree page holds no block's entry (the
    meta pages, a branch page, the databases' own records: every block hangs from them)."""
    out: set[int] = set()
    for pg, ids in pages.items():
        if _changed(old, new, pg * PAGE, PAGE):
            out |= ids or set(range(N_BLOCKS))
    return out


def _changed(old: bytes, new: bytes, off: int, n: int) -> bool:
    """Did bytes [off, off+n) change? A cut file reads as zeros past its end (the tiers
    re-extend a truncated file with zeros)."""
    a = old[off : off + n]
    b = new[off : off + n]
    return a != b + bytes(len(a) - len(b))


# -- mutations ---------------------------------------------------------------------------------
def flip(path: Path, rnd: random.Random, lo: int = 0, hi: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    hi = len(data) if hi is None else min(hi, len(data))  # an earlier cut may have shortened it
    if lo >= hi:
        return
    for _ in range(rnd.randint(1, 4)):
        off = rnd.randrange(lo, hi)
        data[off] ^= 1 << rnd.randrange(8)
    path.write_bytes(bytes(data))


def zero_page(path: Path, rnd: random.Random, lo: int = 0, hi: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    hi = len(data) if hi is None else min(hi, len(data))
    if lo >= hi:
        return
    page = rnd.randrange(lo, hi) // 4096 * 4096
    data[page : page + 4096] = bytes(len(data[page : page + 4096]))
    path.write_bytes(bytes(data))


def truncate(path: Path, rnd: random.Random) -> None:
    size = path.stat().st_size
    os.truncate(path, rnd.randrange(size))


def mutate_nvme(store: Path, rnd: random.Random, slot_ranges: list[tuple[int, int]]) -> str:
    slab, index = store / "slab", store / "index"
    what = rnd.choices(
        [
            "slab-flip-block",
            "slab-flip-any",
            "slab-zero-page",
            "slab-truncate",
            "index-flip",
            "index-zero-page",
            "index-truncate",
            "index-delete",
            "meta-delete",
        ],
        weights=[6, 3, 3, 1, 3, 1, 1, 1, 1],
    )[0]
    if what in ("index-flip", "index-zero-page", "index-truncate", "index-delete") and (
        not index.exists()
    ):
        what = "slab-flip-block"
    if what == "meta-delete" and not (store / "meta.json").exists():
        what = "slab-flip-any"
    if what == "slab-flip-block":
        lo, n = rnd.choice(slot_ranges)
        flip(slab, rnd, lo, lo + n)
    elif what == "slab-flip-any":
        flip(slab, rnd)
    elif what == "slab-zero-page":
        zero_page(slab, rnd)
    elif what == "slab-truncate":
        truncate(slab, rnd)
    elif what == "index-flip":
        flip(index, rnd)
    elif what == "index-zero-page":
        zero_page(index, rnd)
    elif what == "index-truncate":
        truncate(index, rnd)
    elif what == "index-delete":
        index.unlink()
    else:
        (store / "meta.json").unlink()
    return what


def mutate_lmdb(store: Path, rnd: random.Random, ranges: dict[int, list[tuple[int, int]]]) -> str:
    data = store / "data.mdb"
    what = rnd.choices(
        ["value-flip", "header-flip", "value-zero-page", "lock-delete", "any-flip", "truncate"],
        weights=[6, 3, 3, 1, 2, 1],
    )[0]
    (ho, hn), (vo, vn) = ranges[rnd.choice(sorted(ranges))]
    if what == "value-flip":
        flip(data, rnd, vo, vo + vn)
    elif what == "header-flip":
        flip(data, rnd, ho, ho + hn)
    elif what == "value-zero-page":
        zero_page(data, rnd, vo, vo + vn)
    elif what == "lock-delete":
        (store / "lock.mdb").unlink(missing_ok=True)
    elif what == "any-flip":
        flip(data, rnd)
    else:
        truncate(data, rnd)
    return what


# -- the campaign ------------------------------------------------------------------------------
def nvme_expectations(base: Path, store: Path) -> tuple[set[int], set[int], set[int], set[int]]:
    """(data-mutated with the record intact, record damaged, records cut whole, all lost)."""
    sb, slot_of, record_of = nvme_layout(base)
    if not (store / "index").exists():
        everything = set(slot_of)
        return set(), set(), set(), everything
    old_slab, new_slab = (base / "slab").read_bytes(), (store / "slab").read_bytes()
    old_idx, new_idx = (base / "index").read_bytes(), (store / "index").read_bytes()
    rs = nvme.REC_SIZE
    used = fmt.HEADER_SIZE + BB["nvme"]  # a slot's padding is no part of its block
    data_hit = {i for i, s in slot_of.items() if _changed(old_slab, new_slab, s * sb, used)}
    cut_whole = {i for i, r in record_of.items() if len(new_idx) <= r * rs}
    record_hit = {
        i
        for i, r in record_of.items()
        if i not in cut_whole and _changed(old_idx, new_idx, r * rs, rs)
    }
    data_only = data_hit - record_hit - cut_whole
    return data_only, record_hit, cut_whole, data_only | record_hit | cut_whole


def corruption_campaign(kind: str, tmp_path: Path, mutations: int, seed: int) -> dict:
    base = tmp_path / "base"
    build_base(kind, base)
    rnd = random.Random(seed)
    figures: dict = dict(
        mutations=0, rounds=0, mutated_blocks=0, misses_counted=0, forgotten=0,
        untouched_read=0, wrong=0, blocks_lost=0, refused=0, kinds={},
        structural_rounds=0, lost_to_tree_damage=0, exposed_to_tree_damage=0,
    )  # fmt: skip
    # blocks_lost: untouched blocks not served in rounds whose damage hit only block bytes
    # (values, headers, NVMe files: each block checksummed), where none may go. LMDB rounds
    # with a flip anywhere in data.mdb or a truncation may hit LMDB's own tree pages, which
    # carry no checksum: the guarantee there is no wrong byte and a clear refusal, not that
    # every untouched block stays reachable. An untouched block such a round makes
    # unreachable is a loss, not an eviction: no event reports it and the store no longer
    # knows it holds it (its bytes may be on disk, no tree reaches them); it reads as a
    # miss. Counted as `lost_to_tree_damage`, and bounded: only a block with an entry on a
    # damaged tree page (`exposed_by_tree_damage`) may be lost so; damage to a value page
    # or to free space loses nothing. `refused`: stores the damage made unopenable.
    if kind == "nvme":
        sb, slot_of, _ = nvme_layout(base)
        targets = [(s * sb, fmt.HEADER_SIZE + BB[kind]) for s in slot_of.values()]
    else:
        ranges = lmdb_layout(base)
        tree_pages = lmdb_tree_pages(base)
    r = 0
    while figures["mutations"] < mutations:
        store = tmp_path / f"round-{r}"
        copy_store(base, store)
        done = []
        for _ in range(rnd.choice([1, 1, 2, 3])):
            if kind == "nvme":
                done.append(mutate_nvme(store, rnd, targets))
            else:
                done.append(mutate_lmdb(store, rnd, ranges))
        for w in done:
            figures["kinds"][w] = figures["kinds"].get(w, 0) + 1
        figures["mutations"] += len(done)
        # What the mutations hit, judged from the files before anything reopens them.
        if kind == "nvme":
            data_only, record_hit, cut_whole, lost = nvme_expectations(base, store)
        else:
            new = (store / "data.mdb").read_bytes()
            old = (base / "data.mdb").read_bytes()
            lost = {i for i, rg in ranges.items() if any(_changed(old, new, o, n) for o, n in rg)}
        extra = [10_000 + 10 * r + j for j in range(3)]
        got = run_child(probe_cache, config(kind, store), BB[kind], list(range(N_BLOCKS)), extra)
        structural = kind == "lmdb" and {"any-flip", "truncate"} & set(done)
        if "refused" in got:
            # Only damage to LMDB's own pages may make a store unopenable, and then clearly.
            assert structural, f"round {r} ({done}): refused: {got['refused']}"
            assert "damaged" in got["refused"] or "path" in got["refused"], got["refused"]
            figures["refused"] += 1
            figures["structural_rounds"] += 1
            shutil.rmtree(store)
            r += 1
            continue
        hit, miss = set(got["hit"]), set(got["miss"])
        figures["wrong"] += len(got["wrong"])
        assert got["wrong"] == [], f"round {r} ({done}): wrong bytes served for {got['wrong']}"
        assert got["serving"], f"round {r} ({done}): the cache stopped serving"
        if kind == "nvme":
            rep = got["open_report"]
            assert miss == lost, f"round {r} ({done}): misses {miss} != mutated {lost}"
            assert got["errors"] + rep["blocks_dropped"] == len(data_only), (done, got)
            assert rep["records_skipped"] >= len(record_hit), (done, got)
            if rep.get("index_missing"):
                counted = len(lost)
            else:
                counted = got["errors"] + rep["blocks_dropped"] + len(record_hit)
            figures["forgotten"] += len(cut_whole)
        else:
            counted = got["errors"] + got["open_report"]["blocks_dropped"]
            if structural:
                assert lost <= miss, f"round {r} ({done}): mutated {lost - miss} served"
            else:
                assert miss == lost, f"round {r} ({done}): misses {miss} != mutated {lost}"
                assert counted == len(lost), (done, got)
        figures["mutated_blocks"] += len(lost)
        figures["misses_counted"] += counted
        figures["untouched_read"] += len(hit)
        unreachable = (set(range(N_BLOCKS)) - lost) - hit
        if structural:
            exposed = exposed_by_tree_damage(tree_pages, old, new) - lost
            assert unreachable <= exposed, (
                f"round {r} ({done}): untouched blocks {sorted(unreachable - exposed)} "
                "unreachable with no entry on a damaged tree page"
            )
            figures["structural_rounds"] += 1
            figures["lost_to_tree_damage"] += len(unreachable)
            figures["exposed_to_tree_damage"] += len(exposed)
        else:
            figures["blocks_lost"] += len(unreachable)
        figures["rounds"] += 1
        shutil.rmtree(store)
        r += 1
    return report("corruption", tier=kind, seed=seed, **figures)


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_corruption_campaign(kind: str, tmp_path) -> None:
    figures = corruption_campaign(kind, tmp_path, scale("corruption_mutations", 120), seed=7)
    assert figures["blocks_lost"] == 0 and figures["wrong"] == 0
    assert figures["mutated_blocks"] > 0


def test_tree_damage_exposes_only_the_blocks_on_the_damaged_page(tmp_path) -> None:
    # The bound on `lost_to_tree_damage`: a changed value page exposes no block, a changed
    # leaf page the blocks with an entry on it, a changed meta page every block.
    base = tmp_path / "base"
    build_base("lmdb", base)
    pages, old = lmdb_tree_pages(base), (base / "data.mdb").read_bytes()
    (ho, _), (vo, _) = lmdb_layout(base)[5]

    def flipped(off: int) -> bytes:
        new = bytearray(old)
        new[off] ^= 1
        return bytes(new)

    assert exposed_by_tree_damage(pages, old, flipped(vo + 100)) == set()  # a value page
    leaf = ho // PAGE
    assert 5 in pages[leaf] and exposed_by_tree_damage(pages, old, flipped(ho)) == pages[leaf]
    assert exposed_by_tree_damage(pages, old, flipped(40)) == set(range(N_BLOCKS))  # meta


@pytest.mark.stress
@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_corruption_campaign_long(kind: str, tmp_path) -> None:
    figures = corruption_campaign(kind, tmp_path, scale("corruption_mutations", 1200), seed=2026)
    assert figures["blocks_lost"] == 0 and figures["wrong"] == 0
    assert figures["mutations"] >= 1000


# -- regressions found by this campaign ---------------------------------------------------------
def _pages(data: bytes, flag: int) -> list[int]:
    """Offsets of the LMDB pages whose header flags (uint16 at byte 10) include `flag`
    (0x02 leaf, 0x04 overflow); pages 0 and 1 are the meta pages."""
    return [
        off
        for off in range(2 * 4096, len(data), 4096)
        if struct.unpack_from("<H", data, off + 10)[0] & flag
        and struct.unpack_from("<Q", data, off)[0] == off // 4096
    ]


def test_lmdb_with_damaged_tree_pages_is_refused_with_a_clear_error(tmp_path) -> None:
    # Zeroing every leaf page breaks LMDB's own tree (no checksum there): opening used to
    # raise lmdb.CorruptedError out of TierCache.open; now a ConfigError names the store.
    base = tmp_path / "base"
    build_base("lmdb", base)
    data = bytearray((base / "data.mdb").read_bytes())
    leaves = _pages(bytes(data), 0x02)
    assert leaves
    for off in leaves:
        data[off : off + 4096] = bytes(4096)
    (base / "data.mdb").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: .*LMDB environment is damaged"):
        TierCache.open(config("lmdb", base), block_bytes=BB["lmdb"])


def test_lmdb_block_that_cannot_be_deleted_does_not_stop_later_stores(tmp_path) -> None:
    # A zeroed first overflow page: the block's read fails its checksum (a counted miss), and
    # LMDB cannot delete the entry (MDB_CORRUPTED). That pending delete used to fail every
    # later write transaction, so the tier stopped storing and close() raised.
    base = tmp_path / "base"
    build_base("lmdb", base)
    _, (vo, _) = lmdb_layout(base)[5]
    data = bytearray((base / "data.mdb").read_bytes())
    first = vo - 16  # the value follows its overflow run's 16-byte page header
    assert first % 4096 == 0 and first in _pages(bytes(data), 0x04)
    data[first : first + 4096] = bytes(4096)
    (base / "data.mdb").write_bytes(bytes(data))
    cache = TierCache.open(config("lmdb", base), block_bytes=BB["lmdb"])
    try:
        assert len(cache.get([key(5)])) == 0
        assert cache.stats()["lmdb"]["errors"] == 1
        new = [100, 101, 102]
        assert cache.put([key(i) for i in new], blocks(new, BB["lmdb"])) == 3
        assert torch.equal(cache.get([key(i) for i in new]), blocks(new, BB["lmdb"]))
        assert torch.equal(cache.get([key(4)]), blocks([4], BB["lmdb"]))
    finally:
        cache.close()  # used to raise OSError (mdb_del: MDB_CORRUPTED) from flush
    # Reopened: the undeletable entry is found again, fails again, and nothing else is lost.
    with TierCache.open(config("lmdb", base), block_bytes=BB["lmdb"]) as cache:
        assert len(cache.get([key(5)])) == 0
        assert cache.lookup([key(i) for i in (100, 101, 102)]) == 3


# -- fuzz targets ------------------------------------------------------------------------------
_HEAD = struct.Struct("<4sHBB16sQIIQQ")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    magic=st.sampled_from([fmt.MAGIC, b"TCB\x02", b"\x00\x00\x00\x00"]),
    version=st.sampled_from([fmt.FORMAT_VERSION, 0, 2, 0xFFFF]),
    codec=st.integers(0, 255),
    raw_len=st.integers(0, 2**32 - 1) | st.sampled_from([63, 64, 65, 127, 128]),
    stored_len=st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 64, 127, 128]),
    seq=st.integers(0, 2**64 - 1),
    stored=st.binary(max_size=300) | st.sampled_from([b"", b"\x28\xb5\x2f\xfd" + bytes(20)]),
    compressed=st.sampled_from(["no", "frame", "fitting frame"]),
    dst_len=st.sampled_from([64, 65, 127, 128]),
)
def test_fuzz_forged_headers_raise_only_block_corrupt(
    magic, version, codec, raw_len, stored_len, seq, stored, compressed, dst_len
) -> None:
    """Header fields set arbitrarily and the checksum recomputed (a forged, self-consistent
    record, as a bug or an attacker could write it): decoding into a block-sized buffer
    either yields exactly `dst_len` bytes or raises BlockCorruptError; nothing else escapes.
    Found: a shuffled (codec 2) block of odd length raised numpy's ValueError."""
    if compressed != "no":  # a real zstd frame, so the decompression paths run
        import zstandard

        if compressed == "fitting frame":  # lengths that agree, so decoding goes all the way
            stored, raw_len = stored[:dst_len].ljust(dst_len, b"\0"), dst_len
        stored = zstandard.ZstdCompressor().compress(stored or b"x")
        stored_len = len(stored) if stored_len % 2 or compressed == "fitting frame" else stored_len
    prefix = _HEAD.pack(magic, version, codec, 0, bytes(16), 1, raw_len, stored_len, seq, 0)
    checksum = xxhash.xxh3_64(prefix + stored).intdigest()
    record = prefix + struct.pack("<Q", checksum)
    dst = np.zeros(dst_len, dtype=np.uint8)
    try:
        h = fmt.decode_header(record)
        fmt.decode_payload(h, stored, dst)
    except BlockCorruptError:
        return
    assert h.raw_len == dst_len


def test_forged_shuffled_block_of_odd_length_is_corrupt() -> None:
    # Regression (found by the fuzz target above): decode_payload raised ValueError.
    import zstandard

    raw = bytes(range(65))
    stored = zstandard.ZstdCompressor().compress(raw)
    prefix = _HEAD.pack(
        fmt.MAGIC, 1, fmt.CODEC_ZSTD_SHUFFLE2, 0, bytes(16), 1, 65, len(stored), 1, 0
    )
    record = prefix + struct.pack("<Q", xxhash.xxh3_64(prefix + stored).intdigest())
    with pytest.raises(BlockCorruptError, match="odd length"):
        fmt.decode_payload(fmt.decode_header(record), stored, np.zeros(65, dtype=np.uint8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from([nvme.OP_PUT, nvme.OP_FREE, nvme.OP_BASE, 0, 9]),
            st.integers(0, 40),  # slots, some beyond the capacity of 8
            st.integers(0, 2**64 - 1) | st.integers(0, 20),
            st.integers(0, 11),  # key ids: 0..5 were stored, the rest never
            st.booleans(),  # a damaged checksum
        ),
        max_size=40,
    ),
    st.binary(max_size=45),
)
def test_fuzz_nvme_index_journal(tmp_path_factory, records, tail) -> None:
    """Any journal (valid, forged or damaged records, any order, a torn tail) opens without
    an exception, and every block it then serves is exactly what was written for its key."""
    store = tmp_path_factory.mktemp("journal") / "nvme"
    t = open_tier("nvme", store, 64, 8)
    ids = list(range(6))
    t.write(t.allocate([key(i) for i in ids]), blocks(ids, 64), [key(i) for i in ids])
    t.close()
    journal = bytearray((store / "index").read_bytes())
    for op, slot, seq, kid, bad in records:
        rec = bytearray(nvme.pack_record(op, slot, seq, key(kid)))
        if bad:
            rec[-1] ^= 0xFF
        journal += rec
    (store / "index").write_bytes(bytes(journal) + tail)
    t = open_tier("nvme", store, 64, 8)
    try:
        rec = t.recover()
        assert len({s for _, s in rec}) == len(rec) and all(0 <= s < 8 for _, s in rec)
        if rec:
            out = torch.empty((len(rec), 64), dtype=torch.uint8)
            bad = set(t.read([s for _, s in rec], out, [k for k, _ in rec]))
            for j, (k, _) in enumerate(rec):
                if j not in bad:
                    assert torch.equal(out[j], blocks([int.from_bytes(k, "big")], 64)[0])
    finally:
        t.close()


@settings(max_examples=150, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(
            st.sampled_from(["format", "version", "block_bytes", "x"]),
            st.none() | st.booleans() | st.integers(-5, 2**70) | st.text(max_size=20),
            max_size=4,
        ),
    )
)
def test_fuzz_lmdb_metadata_parser(raw) -> None:
    """Arbitrary metadata bytes: a ConfigError naming the store, or a dict with a valid
    block size. JSON only: nothing is unpickled or evaluated."""
    try:
        meta = lmdb_tier.parse_meta("/store", raw)
    except ConfigError as exc:
        assert exc.field == "path" and "/store" in exc.problem
        return
    assert meta["format"] == lmdb_tier.STORE_FORMAT
    bb = meta["block_bytes"]
    assert isinstance(bb, int) and not isinstance(bb, bool) and bb >= 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=120)
    | st.builds(
        lambda d: json.dumps(d).encode(),
        st.fixed_dictionaries(
            {},
            optional={
                "format": st.sampled_from(["tiercache-nvme", "other", 1]),
                "version": st.sampled_from([1, 2, "1", None]),
                "block_bytes": st.sampled_from([64, 128, -1, "64", True]),
                "slot_bytes": st.sampled_from([4096, 8192, 0]),
                "header_bytes": st.sampled_from([64, 32]),
                "capacity_blocks": st.integers(-3, 100),
            },
        ),
    )
)
def test_fuzz_nvme_metadata(tmp_path_factory, raw) -> None:
    """An arbitrary meta.json: the store opens (and serves its blocks exactly) or is refused
    with a ConfigError; never another exception."""
    store = tmp_path_factory.mktemp("meta") / "nvme"
    t = open_tier("nvme", store, 64, 8)
    t.write(t.allocate([key(1)]), blocks([1], 64), [key(1)])
    t.close()
    (store / "meta.json").write_bytes(raw)
    try:
        t = open_tier("nvme", store, 64, 8)
    except ConfigError:
        return
    try:
        for k, s in t.recover():
            out = torch.empty((1, 64), dtype=torch.uint8)
            if t.read([s], out, [k]) == []:
                assert torch.equal(out, blocks([int.from_bytes(k, "big")], 64))
    finally:
        t.close()
