"""The spec of head shards (issue 32, docs/tp-layout.md): `tiercache.transfer.head_shards` and
`tiercache.hashing.shard_keys`.

On real torch tensors in vLLM's CPU layouts, a TP=1 engine and TP=2 and TP=4 engines holding
the same KV split by heads (rank `r` of `n` holds heads ``[r*H/n, (r+1)*H/n)``), each seen by
`HeadShards.unit_views` and copied by a real `KVLayout`:
- TP=1's shard `j` of a block is, byte for byte, TP=n rank ``j // local``'s local shard
  ``j % local`` of the same block, and the documented bytes (per layer, its heads' pages);
- gathering every rank's shards and scattering them into a zeroed engine of another TP size
  gives that engine's tensors exactly;
- layouts whose heads are not outermost and contiguous in a block are refused, naming the layer;
- through the transfer engine as the KV connector drives it, on real CPU, NVMe and LMDB tiers:
  TP=2 ranks store, a TP=1 engine loads (a hit only once every shard is there), and back.
Then `HeadShards`' bookkeeping, the shard key format (pinned digests) and `default_shards`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from xxhash import xxh3_128_digest

from tiercache import TierCache
from tiercache.hashing import prefix_hashes, shard_keys
from tiercache.transfer import build_worker
from tiercache.transfer.head_shards import HeadShards, default_shards
from tiercache.transfer.kv_layout import KVLayout
from tiercache.transfer.specs import load_transfers, store_transfers

L, H, BS, HS = 3, 4, 4, 8  # layers, KV heads (TP=1), tokens per block, head size
NB = 5  # engine blocks (not 2: [2, 2, ...] would read as K/V first)
# How each engine places the 4 logical blocks: engines of different TP sizes (different
# processes) hold the same tokens at different engine block ids.
PLACES = {1: [3, 0, 4, 1], 2: [1, 4, 0, 2], 4: [2, 3, 1, 0]}
LAYOUTS = [
    "layers_outer",  # one allocation [L, nb, H, bs, 2*hs], layer views (vLLM's CPU backend)
    "separate",  # one allocation [nb, H, bs, 2*hs] per layer
    "kv_first",  # one allocation [2, nb, H, bs, hs] per layer (K/V first, heads outer)
]
DTYPES = [torch.float32, torch.bfloat16]


def values(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The logical KV `[L, blocks, H, bs, 2*hs]` (K in the first `hs`, V in the rest): random
    bit patterns, NaNs included, so every comparison below is of bits."""
    g = torch.Generator().manual_seed(seed)
    n = len(PLACES[1])
    if dtype.itemsize == 4:
        bits = torch.randint(-(2**31), 2**31 - 1, (L, n, H, BS, 2 * HS), generator=g)
        return bits.to(torch.int32).view(dtype)
    bits = torch.randint(-(2**15), 2**15 - 1, (L, n, H, BS, 2 * HS), generator=g)
    return bits.to(torch.int16).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def engine(kind: str, v: torch.Tensor, tp: int, rank: int, *, zero: bool = False):
    """Rank `rank` of a TP=`tp` engine holding `v`'s heads of that rank at `PLACES[tp]`
    (the other engine blocks random), in layout `kind`: layer name -> tensor."""
    h = H // tp
    heads = slice(rank * h, (rank + 1) * h)
    g = torch.Generator().manual_seed(100 * tp + rank)
    shape = {
        "layers_outer": (L, NB, h, BS, 2 * HS),
        "separate": (L, NB, h, BS, 2 * HS),
        "kv_first": (L, 2, NB, h, BS, HS),
    }[kind]
    store = torch.randint(0, 256, (*shape[:-1], shape[-1] * v.element_size()), generator=g)
    store = store.to(torch.uint8).view(v.dtype)
    if zero:
        store.zero_()
    for b, e in enumerate([] if zero else PLACES[tp]):
        if kind == "kv_first":
            store[:, 0, e] = v[:, b, heads, :, :HS]
            store[:, 1, e] = v[:, b, heads, :, HS:]
        else:
            store[:, e] = v[:, b, heads]
    if kind == "layers_outer":
        return {f"layer.{i}": store[i] for i in range(L)}  # views of ONE allocation
    return {f"layer.{i}": store[i].clone() for i in range(L)}  # one allocation per layer


def expected_shard(kind: str, v: torch.Tensor, b: int, j: int, g: int) -> torch.Tensor:
    """The documented bytes of shard `j` (of `g` heads) of logical block `b`: per layer (in
    registration order, here also address order), its heads' pages; K then V when K/V first."""
    heads = slice(j * g, (j + 1) * g)
    parts = []
    for layer in range(L):
        page = v[layer, b, heads]
        if kind == "kv_first":
            parts += [bits(page[..., :HS]).flatten(), bits(page[..., HS:]).flatten()]
        else:
            parts.append(bits(page).flatten())
    return torch.cat(parts)


def unit_layout(hs: HeadShards, kv: dict[str, torch.Tensor]) -> KVLayout:
    return KVLayout(hs.unit_views(kv, NB, heads=_heads(kv)), NB * hs.local)


def gather_all(hs: HeadShards, kv: dict[str, torch.Tensor], tp: int) -> torch.Tensor:
    """This rank's shard units of every logical block, block-major (the order of `keys`)."""
    layout = unit_layout(hs, kv)
    units = hs.units(PLACES[tp])
    out = torch.empty((len(units), layout.block_bytes), dtype=torch.uint8)
    layout.gather(units, out)
    return out


def tp_sizes(shards: int) -> list[int]:
    return [n for n in (1, 2, 4) if shards % n == 0 and H % n == 0]


# -- the bytes of a shard are the same on every TP size ---------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shards", [4, 2])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_shard_holds_the_same_bytes_on_every_tp_size(kind, shards, dtype) -> None:
    v = values(dtype)
    g = H // shards
    whole = gather_all(HeadShards(shards), engine(kind, v, 1, 0), 1)
    assert whole.shape[1] == L * g * BS * 2 * HS * v.element_size()
    for b in range(len(PLACES[1])):
        for j in range(shards):
            want = expected_shard(kind, v, b, j, g)
            assert torch.equal(whole[b * shards + j], want), (b, j)
    for tp in tp_sizes(shards)[1:]:
        for r in range(tp):
            hs = HeadShards(shards, tp, r)
            mine = gather_all(hs, engine(kind, v, tp, r), tp)
            assert mine.shape == (len(PLACES[1]) * hs.local, whole.shape[1])
            for b in range(len(PLACES[1])):
                for j in hs.owned:
                    local = j - r * hs.local
                    assert torch.equal(mine[b * hs.local + local], whole[b * shards + j]), (
                        tp,
                        r,
                        b,
                        j,
                    )


def scatter_all(hs: HeadShards, kv: dict[str, torch.Tensor], tp: int, rows: torch.Tensor):
    layout = unit_layout(hs, kv)
    layout.scatter(hs.units(PLACES[tp]), rows)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), name


@pytest.mark.parametrize("shards", [4, 2])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_round_trips_between_tp_sizes(kind: str, shards: int) -> None:
    v = values(torch.float32, seed=1)
    one = HeadShards(shards)
    original = engine(kind, v, 1, 0)
    # Zero the blocks that do not hold tokens, so that a round trip must rebuild them all.
    for t in original.values():
        for e in (e for e in range(NB) if e not in PLACES[1]):
            (t[:, e] if kind == "kv_first" else t[e]).zero_()
    for tp in tp_sizes(shards)[1:]:
        # TP=n ranks -> a zeroed TP=1 engine: every shard from the rank that owns it.
        ranks = [HeadShards(shards, tp, r) for r in range(tp)]
        parts = [gather_all(hs, engine(kind, v, tp, hs.tp_rank), tp) for hs in ranks]
        rows = torch.stack([p.view(len(PLACES[1]), -1, p.shape[1]) for p in parts], dim=1)
        fresh = engine(kind, v, 1, 0, zero=True)
        scatter_all(one, fresh, 1, rows.reshape(-1, parts[0].shape[1]))
        assert_same(fresh, original)
        # TP=1 -> zeroed TP=n ranks: each takes exactly its own shards.
        whole = gather_all(one, original, 1).view(len(PLACES[1]), shards, -1)
        for hs in ranks:
            fresh = engine(kind, v, tp, hs.tp_rank, zero=True)
            mine = whole[:, hs.owned.start : hs.owned.stop].reshape(-1, whole.shape[2])
            scatter_all(hs, fresh, tp, mine.contiguous())
            want = engine(kind, v, tp, hs.tp_rank)
            for name, t in fresh.items():  # the placed blocks equal; the others stay zero
                for e in range(NB):
                    got = t[:, e] if kind == "kv_first" else t[e]
                    exp = want[name][:, e] if kind == "kv_first" else want[name][e]
                    if e in PLACES[tp]:
                        assert torch.equal(bits(got), bits(exp)), (tp, hs.tp_rank, name, e)
                    else:
                        assert not bits(got).any()


@pytest.mark.parametrize("kind", LAYOUTS)
def test_unit_views_are_views_of_the_engine_buffer(kind: str) -> None:
    kv = engine(kind, values(torch.float32), 2, 1)
    hs = HeadShards(4, 2, 1)  # local 2, g = 1
    views = hs.unit_views(kv, NB, heads=_heads(kv))
    for name, t in kv.items():
        u = views[name]
        assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        for unit in range(NB * hs.local):
            b, j = divmod(unit, hs.local)
            if kind == "kv_first":
                assert torch.equal(bits(u[:, unit]), bits(t[:, b, j : j + 1]))
            else:
                assert torch.equal(bits(u[unit]), bits(t[b, j : j + 1]))
    first = views["layer.0"]
    (first[:, 3] if kind == "kv_first" else first[3]).fill_(7.0)  # unit 3 = block 1, head 1
    page = kv["layer.0"][:, 1, 1] if kind == "kv_first" else kv["layer.0"][1, 1]
    assert bool((page == 7.0).all())


# -- layouts refused --------------------------------------------------------------------------
def test_unit_views_refuse_a_block_major_cross_layer_allocation() -> None:
    a = torch.zeros(NB, L, H, BS, 2 * HS)  # [nb, L, H, bs, 2hs]: layers inside a block
    kv = {f"layer.{i}": a[:, i] for i in range(L)}
    with pytest.raises(ValueError, match=r"kv_caches\['layer.0'\].*LBHNC"):
        HeadShards(2).unit_views(kv, NB, heads=_heads(kv))


def _heads(kv: dict[str, torch.Tensor]) -> int:
    """A rank's KV heads in these layouts (dim -3 in each)."""
    return next(iter(kv.values())).shape[-3]


@pytest.mark.parametrize("kind", ["separate", "kv_first"])
def test_unit_views_refuse_heads_not_divisible_by_the_local_shards(kind: str) -> None:
    shape = (NB, 3, BS, 2 * HS) if kind == "separate" else (2, NB, 3, BS, HS)
    kv = {"attn.1": torch.zeros(shape)}
    with pytest.raises(ValueError, match=r"kv_caches\['attn.1'\].*3 KV heads"):
        HeadShards(2).unit_views(kv, NB, heads=3)
    with pytest.raises(ValueError, match=r"kv_caches\['attn.1'\]"):
        HeadShards(4, 2, 0).unit_views(kv, NB, heads=3)  # 2 local shards of 3 heads
    HeadShards(6, 2, 1).unit_views(kv, NB, heads=3)  # 3 local shards of one head: fine


def test_unit_views_refuse_a_tensor_that_is_not_blocks_first() -> None:
    with pytest.raises(ValueError, match=r"kv_caches\['x'\].*num_blocks=5"):
        HeadShards(1).unit_views({"x": torch.zeros(NB + 1, H, BS, 2 * HS)}, NB, heads=H)
    with pytest.raises(ValueError, match=r"kv_caches\['x'\]"):
        HeadShards(1).unit_views({"x": torch.zeros(NB, H)}, NB, heads=H)


def test_unit_views_refuse_a_layer_after_accepting_others() -> None:
    ok = torch.zeros(NB, H, BS, 2 * HS)
    bad = torch.zeros(NB, L, H, BS, 2 * HS)[:, 0]
    with pytest.raises(ValueError, match=r"kv_caches\['second'\]"):
        HeadShards(2).unit_views({"first": ok, "second": bad}, NB, heads=H)


def test_unit_views_refuse_an_nhd_layout() -> None:
    kv = {"layer.0": torch.zeros(2, NB, 2 * BS, H, HS)}  # tokens (8) outside heads (4)
    with pytest.raises(ValueError, match=r"kv_caches\['layer.0'\]"):
        HeadShards(2).unit_views(kv, NB, heads=H)


def test_unit_views_refuse_an_nhd_layout_whose_tokens_do_not_split() -> None:
    kv = {"layer.0": torch.zeros(2, NB, 3, H, HS)}
    with pytest.raises(ValueError, match=r"kv_caches\['layer.0'\]"):
        HeadShards(2).unit_views(kv, NB, heads=H)


def test_unit_views_read_two_blocks_of_two_heads_by_heads_or_refuse() -> None:
    t = torch.arange(2 * 2 * BS * 2 * HS, dtype=torch.float32).view(2, 2, BS, 2 * HS)
    try:
        u = HeadShards(2).unit_views({"layer.0": t}, 2, heads=2)["layer.0"]
    except ValueError as exc:  # refusing the ambiguous shape is fine too
        assert "kv_caches['layer.0']" in str(exc)
        return
    assert u.shape == (4, 1, BS, 2 * HS)
    for unit in range(4):  # unit = block * 2 + head
        assert torch.equal(u[unit], t[unit // 2, unit % 2 : unit % 2 + 1])


# -- HeadShards bookkeeping -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "shards: expected an int >= 1"),
        ((True,), "shards: expected an int >= 1"),
        ((2.0,), "shards: expected an int >= 1"),
        ((4, 0), "tp_size: expected an int >= 1"),
        ((4, True), "tp_size: expected an int >= 1"),
        ((4, 3), "serves TP sizes dividing 4, not 3"),
        ((2, 4), "serves TP sizes dividing 2, not 4"),
        ((4, 2, 2), r"tp_rank: expected 0 <= tp_rank < 2, got 2"),
        ((4, 2, -1), r"tp_rank: expected 0 <= tp_rank < 2, got -1"),
    ],
)
def test_head_shards_refuse_bad_arguments(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeadShards(*args)


@pytest.mark.parametrize("rank", [1.5, True, "1"])
def test_head_shards_refuse_a_rank_that_is_not_an_int(rank) -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        HeadShards(4, 2, rank)


def test_head_shards_of_each_rank() -> None:
    assert HeadShards(8).local == 8 and HeadShards(8).owned == range(8)
    got = [(h.local, h.owned) for h in (HeadShards(8, 4, r) for r in range(4))]
    assert got == [(2, range(0, 2)), (2, range(2, 4)), (2, range(4, 6)), (2, range(6, 8))]
    assert HeadShards(8, 8, 5).owned == range(5, 6)
    # Records: frozen and compared by value.
    assert HeadShards(8, 2, 1) == HeadShards(8, 2, 1)
    with pytest.raises(AttributeError):
        HeadShards(8).shards = 4  # type: ignore[misc]


def block_keys(n: int) -> list[bytes]:
    return prefix_hashes(list(range(4 * n)), 4, namespace="test/head-shards")


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_a_ranks_keys_are_its_slice_of_every_ranks_keys(shards: int) -> None:
    keys = block_keys(3)
    for tp in (n for n in (1, 2, 4, 8) if shards % n == 0):
        every = HeadShards(shards, tp, 0).all_keys(keys)
        assert every == HeadShards(shards).keys(keys)  # all_keys does not depend on the rank
        assert len(every) == 3 * shards and len(set(every)) == 3 * shards
        union = []
        for r in range(tp):
            hs = HeadShards(shards, tp, r)
            assert hs.all_keys(keys) == every
            mine = hs.keys(keys)
            assert len(mine) == 3 * hs.local
            for b in range(3):  # block-major: block b's owned shards
                lo = b * shards + hs.owned.start
                assert mine[b * hs.local : (b + 1) * hs.local] == every[lo : lo + hs.local]
            union += mine
        assert sorted(union) == sorted(every)  # no shard twice, none missing
        assert set(every).isdisjoint(keys)  # a shard key is never a block key


def test_units_and_blocks() -> None:
    hs = HeadShards(8, 2, 1)  # local 4
    assert hs.units([3, 0]) == [12, 13, 14, 15, 0, 1, 2, 3]
    assert hs.units([]) == []
    assert hs.blocks([12, 15, 1]) == {3, 0}
    assert hs.blocks(hs.units([7, 2, 9])) == {7, 2, 9}
    assert HeadShards(4).units([2]) == [8, 9, 10, 11]
    assert HeadShards(1).units([5, 1]) == [5, 1]  # one shard: a unit is a block
    assert len(hs.units([3, 0])) == len(hs.keys(block_keys(2)))  # keys and units pair up


def test_whole_counts_whole_blocks_only() -> None:
    hs = HeadShards(8, 2, 0)  # local 4
    assert [hs.whole(n) for n in (0, 3, 4, 7, 8, 9)] == [0, 0, 4, 4, 8, 8]
    assert hs.whole(15, per_block=8) == 8  # every rank's shards (all_keys): 8 per block
    assert hs.whole(16, per_block=8) == 16
    assert HeadShards(1).whole(5) == 5
    for bad in (0, -8, True, 2.0):  # never a silent fallback to `local`
        with pytest.raises(ValueError, match="per_block: expected an int >= 1"):
            hs.whole(8, per_block=bad)


# -- shard keys: the format -------------------------------------------------------------------
KEY = bytes(range(16))
# H(b"tiercache/shard/v1\x00" + u16(j) + k) for k = KEY, computed once (2026-11-27) with
# xxhash.xxh3_128_digest from the formula in tiercache/hashing.py's docstring (u16 as u64:
# little-endian). 258 = 0x0102 pins the byte order.
PINNED = {
    3: "cb05d76e8673d16727a15e9a467369ed",
    258: "24a2018045cc6b649ff3b92e12f00c4a",
}


def test_shard_keys_are_pinned_to_the_documented_formula() -> None:
    for j, digest in PINNED.items():
        formula = xxh3_128_digest(b"tiercache/shard/v1\x00" + j.to_bytes(2, "little") + KEY)
        assert formula.hex() == digest  # the literal is the formula's
        assert shard_keys([KEY], [j]) == [bytes.fromhex(digest)]
    assert shard_keys([KEY], [3, 258]) == [bytes.fromhex(PINNED[3]), bytes.fromhex(PINNED[258])]


def test_shard_keys_are_block_major_and_distinct() -> None:
    keys = block_keys(4)
    got = shard_keys(keys, [0, 1, 2])
    assert len(got) == 12 and all(len(k) == 16 for k in got)
    assert len(set(got)) == 12  # differ per shard index and per block key
    assert got[3:6] == shard_keys([keys[1]], range(3))
    assert shard_keys(keys, [2, 0]) == [k for i in range(4) for k in (got[3 * i + 2], got[3 * i])]
    assert shard_keys([], range(4)) == [] and shard_keys(keys, []) == []
    assert shard_keys(keys, [65535])[0] != shard_keys(keys, [0])[0]


@pytest.mark.parametrize("bad", [-1, 65536, True, 1.0, "1"])
def test_shard_keys_refuse_bad_indices(bad) -> None:
    with pytest.raises(ValueError, match="shards: expected ints in"):
        shard_keys([KEY], [0, bad])


@pytest.mark.parametrize("bad", ["a" * 16, bytearray(16), 7])
def test_shard_keys_refuse_keys_that_are_not_bytes(bad) -> None:
    with pytest.raises(
        TypeError, match=f"keys: expected bytes block keys, got {type(bad).__name__}"
    ):
        shard_keys([KEY, bad], [0])


def test_shard_keys_are_equal_across_processes() -> None:
    code = (
        "from tiercache.hashing import prefix_hashes, shard_keys\n"
        "keys = prefix_hashes(list(range(16)), 4, namespace='test/head-shards')\n"
        "print(b''.join(shard_keys(keys, range(8))).hex())\n"
    )
    want = b"".join(shard_keys(block_keys(4), range(8))).hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == want


# -- default_shards ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "shards"),
    [(1, 1), (2, 2), (3, 1), (4, 4), (6, 2), (8, 8), (12, 4), (16, 8), (32, 8)],
)
def test_default_shards(heads: int, shards: int) -> None:
    assert default_shards(heads) == shards
    assert heads % shards == 0
    HeadShards(shards, shards, shards - 1)  # the largest TP size it serves


@pytest.mark.parametrize("bad", [0, -4, True, 4.0, "8"])
def test_default_shards_refuses_bad_head_counts(bad) -> None:
    with pytest.raises(ValueError, match="total_heads"):
        default_shards(bad)


# -- through the transfer engine and real tiers ------------------------------------------------
def run_all(worker, specs) -> None:
    ids = []
    for spec in specs:
        ids.append(len(ids))
        assert worker.transfer_async(ids[-1], spec)
    assert not worker.wait(ids, timeout=60)
    done = worker.get_finished()
    assert sorted(r.job_id for r in done) == sorted(ids) and all(r.success for r in done)


def open_store(tmp_path, tier: str, block_bytes: int) -> TierCache:
    conf: dict[str, object] = {"kind": tier, "blocks": 64}
    if tier != "cpu":
        conf["path"] = str(tmp_path / tier)
    return TierCache.open({"tiers": [conf]}, block_bytes=block_bytes)


def store_through(cache: TierCache, hs: HeadShards, layout: KVLayout, keys, ids) -> None:
    """As the KV connector's worker: prepare_store -> store_transfers -> complete_store."""
    mine = hs.keys(keys)
    plan = cache.manager.prepare_store(mine)
    assert plan is not None and len(plan.stored_keys) == len(mine)
    with build_worker(layout, cache.tiers) as worker:
        run_all(worker, store_transfers(plan, mine, hs.units(ids)))
    cache.manager.complete_store(mine)


def load_through(cache: TierCache, hs: HeadShards, layout: KVLayout, keys, ids) -> None:
    """A hit only on whole blocks (every shard of every rank), then this rank's shards."""
    found = cache.manager.lookup_ready(hs.all_keys(keys))[0]
    assert hs.whole(found, per_block=hs.shards) == len(keys) * hs.shards
    mine = hs.keys(keys)
    spec = cache.manager.prepare_load(mine)
    with build_worker(layout, cache.tiers) as worker:
        run_all(worker, load_transfers(spec, hs.units(ids)))
    cache.manager.complete_load(mine)


def assert_placed(fresh, want, places) -> None:
    """The blocks at `places` equal `want`'s; the others stayed zero."""
    for name, t in fresh.items():
        for e in range(NB):
            if e in places:
                assert torch.equal(bits(t[e]), bits(want[name][e])), (name, e)
            else:
                assert not bits(t[e]).any(), (name, e)


@pytest.mark.parametrize("tier", ["cpu", "nvme", "lmdb"])
def test_a_tp1_engine_stores_and_tp2_ranks_load_through_one_store(tmp_path, tier: str) -> None:
    v = values(torch.float32, seed=4)
    one = HeadShards(4)
    src = unit_layout(one, engine("layers_outer", v, 1, 0))
    cache = open_store(tmp_path, tier, src.block_bytes)
    keys = block_keys(len(PLACES[1]))
    try:
        store_through(cache, one, src, keys, PLACES[1])
        for r in range(2):
            hs = HeadShards(4, 2, r)
            fresh = engine("layers_outer", v, 2, r, zero=True)
            load_through(cache, hs, unit_layout(hs, fresh), keys, PLACES[2])
            assert_placed(fresh, engine("layers_outer", v, 2, r), PLACES[2])
    finally:
        cache.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme", "lmdb"])
def test_tp2_ranks_store_and_a_tp1_engine_loads_through_one_store(tmp_path, tier: str) -> None:
    # Two TP=2 ranks store their shards into one store, through the transfer engine as the KV
    # connector drives it; a TP=1 engine's hit needs every shard, and it loads them into its
    # own block ids, getting exactly the tensors a TP=1 engine that computed them holds.
    v = values(torch.float32, seed=3)
    one = HeadShards(4)
    fresh = engine("layers_outer", v, 1, 0, zero=True)
    target = unit_layout(one, fresh)
    cache = open_store(tmp_path, tier, target.block_bytes)
    keys = block_keys(len(PLACES[1]))
    try:
        for r in range(2):
            hs = HeadShards(4, 2, r)
            layout = unit_layout(hs, engine("layers_outer", v, 2, r))
            assert layout.block_bytes == target.block_bytes  # one unit size on every TP
            store_through(cache, hs, layout, keys, PLACES[2])
            found = cache.manager.lookup_ready(one.all_keys(keys))[0]
            if r == 0:  # rank 0's shards alone: no whole block for the TP=1 engine
                assert found == 2 and one.whole(found, per_block=4) == 0
        load_through(cache, one, target, keys, PLACES[1])
    finally:
        cache.close()
    assert_placed(fresh, engine("layers_outer", v, 1, 0), PLACES[1])
