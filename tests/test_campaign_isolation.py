# ruff: noqa: E501 - tables of cases read best one per line
"""Isolation and security campaign: namespaces and cache salts never share a hit (also on
one shared store), stores are private (0700 directories, 0600 files, even under umask 0),
a store owned by another user or writable by others is refused, nothing read from disk is
unpickled or evaluated (statically: no such call in the package; dynamically: planted
payloads never run), and crafted keys and namespaces never reach outside the store directory.
"""

from __future__ import annotations

import ast
import os
import pickle
import random
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from tests.campaign_support import REPO, blocks, report
from tiercache import TierCache
from tiercache.errors import ConfigError
from tiercache.tiers.format import namespace_id

BB = 4096


def config(root: Path, namespace: str, kinds=("nvme", "lmdb")) -> dict:
    tiers = [{"kind": "cpu", "blocks": 8}]
    tiers += [{"kind": k, "blocks": 128, "path": str(root / k)} for k in kinds]
    return {"block_size": 4, "namespace": namespace, "tiers": tiers}


# -- isolation -----------------------------------------------------------------------------------
def test_namespaces_and_salts_never_share_a_hit(tmp_path) -> None:
    # Four tenants (two namespaces x two cache salts) share the same store directories (one
    # after the other, as restarted servers would). Each stores the same token sequences with
    # its own bytes, except prompt t which tenant t leaves out: its lookup of that prompt must
    # miss although three other tenants stored exactly those tokens, and every hit it gets
    # carries its own bytes.
    rnd = random.Random(11)
    prompts = [[rnd.randrange(32000) for _ in range(16)] for _ in range(6)]
    tenants = [
        (ns, salt) for ns in ("llama/bf16/tp1/0", "llama/fp8/tp1/0") for salt in (None, "s1")
    ]

    def ids(t: int, p: int) -> range:
        return range(1000 * t + 10 * p, 1000 * t + 10 * p + 4)

    all_keys: list[set[bytes]] = []
    for t, (ns, salt) in enumerate(tenants):
        with TierCache.open(config(tmp_path, ns), block_bytes=BB) as cache:
            extra = [salt] * 4 if salt else None
            mine = set()
            for p, toks in enumerate(prompts):
                ks = cache.hash_tokens(toks, extra_keys=extra)
                mine.update(ks)
                if p != t:
                    assert cache.put(ks, blocks(ids(t, p), BB)) == 4
            all_keys.append(mine)
    for a in range(len(tenants)):  # no tenant's key equals another's
        for b in range(a):
            assert not all_keys[a] & all_keys[b]
    probes = misses = 0
    cross: list[tuple] = []  # (namespace, salt, prompt, blocks served that are not its own)
    for t, (ns, salt) in enumerate(tenants):
        with TierCache.open(config(tmp_path, ns), block_bytes=BB) as cache:
            extra = [salt] * 4 if salt else None
            for p, toks in enumerate(prompts):
                got = cache.get(cache.hash_tokens(toks, extra_keys=extra))
                probes += 1
                if p == t:  # stored by other tenants only: every block served is theirs
                    misses += len(got) == 0
                    if len(got):
                        cross.append((ns, salt, p, len(got)))
                else:  # its own prompt: a full hit, and a block with other bytes is theirs
                    own = blocks(ids(t, p), BB)
                    assert len(got) == len(own), (ns, salt, p, len(got))
                    n = sum(not torch.equal(g, w) for g, w in zip(got, own, strict=True))
                    if n:
                        cross.append((ns, salt, p, n))
    cross_hits = sum(c[-1] for c in cross)
    report(
        "isolation",
        tenants=len(tenants),
        probes=probes,
        cross_tenant_misses=misses,
        cross_hits=cross_hits,
    )
    assert cross_hits == 0, f"blocks served across tenants: {cross}"


def test_a_key_of_another_namespace_is_never_served_by_lmdb(tmp_path) -> None:
    # Even the same 16-byte key (a forged or colliding key) written under another namespace
    # is refused on read by the LMDB tier, which checks the namespace stamped in the header.
    from tiercache.tiers.lmdb import LMDBTier

    k = [b"k" * 16]
    t = LMDBTier(path=str(tmp_path / "l"), block_bytes=BB, capacity_blocks=4, namespace="a")
    t.write(t.allocate(k), blocks([1], BB), k)
    t.close()
    t = LMDBTier(path=str(tmp_path / "l"), block_bytes=BB, capacity_blocks=4, namespace="b")
    try:
        out = torch.empty((1, BB), dtype=torch.uint8)
        assert t.read([0], out, k) == [0]
    finally:
        t.close()


# -- equal caller-supplied keys on one shared store, every persistent tier -------------------
# Keys derived from the namespace can never be equal across tenants, so the test above cannot
# see a tier that mixes tenants up. These give two namespaces the SAME 16-byte keys, on the
# same store, the second tenant opening after the first stored (as a restarted or second
# server would).
EQUAL = [bytes([0xE0 + i]) * 16 for i in range(8)]
PERSISTENT = ["nvme", "lmdb", "redis"]


@pytest.fixture(scope="module")
def redis_url():
    from tests.test_tier_redis import RedisServer, require_redis

    require_redis()  # a skip where redis-server is missing; under CI=true a failure
    d = Path(tempfile.mkdtemp(prefix="tc-iso-redis-"))
    srv = RedisServer(d, "--appendonly", "no")
    yield srv.url
    srv.kill()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(request, tmp_path):
    """A function (namespace, blocks) -> config mapping of one shared store of this kind."""
    kind = request.param
    opts = {"path": str(tmp_path / kind)}
    if kind == "redis":
        opts = {"url": request.getfixturevalue("redis_url"), "prefix": f"iso:{tmp_path.name}:"}

    def make(namespace: str, blocks: int) -> dict:
        tier = {"kind": kind, "blocks": blocks, **opts}
        return {"block_size": 4, "namespace": namespace, "tiers": [tier]}

    make.kind = kind
    return make


def held(cache: TierCache) -> tuple[int, int]:
    (st,) = cache.stats().values()
    return st["used_blocks"], st["ready_blocks"]


@pytest.mark.parametrize("store", PERSISTENT, indirect=True)
def test_equal_keys_of_two_namespaces_never_meet(store) -> None:
    # 1. Tenant A stores 6 blocks under the shared keys.
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert a.put(EQUAL[:6], blocks(range(6), BB)) == 6
    # 2. Tenant B opens the same store: A's blocks are neither served nor counted.
    with TierCache.open(store("tenant-b", 8), block_bytes=BB) as b:
        assert b.lookup(EQUAL[:6]) == 0
        assert len(b.get(EQUAL[:6])) == 0
        assert held(b) == (0, 0)
        # 3. B stores 3 of the same keys with its own bytes, and reads back exactly those.
        assert b.put(EQUAL[:3], blocks(range(100, 103), BB)) == 3
        assert torch.equal(b.get(EQUAL[:3]), blocks(range(100, 103), BB))
        assert held(b) == (3, 3)
    # 4. A's blocks are untouched by B's stores of equal keys: exact bytes, all 6.
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert a.lookup(EQUAL[:6]) == 6
        assert torch.equal(a.get(EQUAL[:6]), blocks(range(6), BB))
        assert held(a) == (6, 6)
    # 5. And B's blocks coexist with A's under the same keys.
    with TierCache.open(store("tenant-b", 8), block_bytes=BB) as b:
        assert torch.equal(b.get(EQUAL[:3]), blocks(range(100, 103), BB))
        assert held(b) == (3, 3)


@pytest.mark.parametrize("store", PERSISTENT, indirect=True)
def test_opening_a_store_deletes_nothing(store) -> None:
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert a.put(EQUAL[:6], blocks(range(6), BB)) == 6
    # Tenant C opens with a capacity of 2 and does nothing; then A itself opens with 2.
    TierCache.open(store("tenant-c", 2), block_bytes=BB).close()
    with TierCache.open(store("tenant-a", 2), block_bytes=BB) as a:
        assert held(a)[0] <= 2  # the capacity bounds what this opener holds...
    # ... but nothing was deleted: A at its old capacity finds all 6, exact.
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert a.lookup(EQUAL[:6]) == 6
        assert torch.equal(a.get(EQUAL[:6]), blocks(range(6), BB))


@pytest.mark.parametrize("store", PERSISTENT, indirect=True)
def test_foreign_blocks_are_never_evicted(store) -> None:
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert a.put(EQUAL[:6], blocks(range(6), BB)) == 6
    # Tenant B churns three times its capacity of 4, equal keys included: its policy evicts
    # only its own blocks, and it never counts more than its own.
    with TierCache.open(store("tenant-b", 4), block_bytes=BB) as b:
        others = [bytes([0xB0 + i]) * 16 for i in range(8)]
        for i, ks in enumerate([EQUAL[:4], others[:4], EQUAL[2:6], others[4:]]):
            assert b.put(ks, blocks(range(200 + 4 * i, 204 + 4 * i), BB)) == 4
            used, ready = held(b)
            assert used == ready <= 4
        assert torch.equal(b.get(others[4:]), blocks(range(212, 216), BB))
    with TierCache.open(store("tenant-a", 8), block_bytes=BB) as a:
        assert torch.equal(a.get(EQUAL[:6]), blocks(range(6), BB))


# -- file modes and ownership ----------------------------------------------------------------------
def test_stores_are_private_even_under_umask_0(tmp_path) -> None:
    old = os.umask(0)
    try:
        with TierCache.open(config(tmp_path, "ns"), block_bytes=BB) as cache:
            ks = [bytes([i]) * 16 for i in range(8)]
            cache.put(ks, blocks(range(8), BB))
        # Reopen: compaction rewrites the journal (index.tmp -> index), meta is rewritten.
        with TierCache.open(config(tmp_path, "ns"), block_bytes=BB):
            pass
    finally:
        os.umask(old)
    checked = 0
    for kind in ("nvme", "lmdb"):
        for p in [tmp_path / kind, *(tmp_path / kind).rglob("*")]:
            mode = stat.S_IMODE(p.lstat().st_mode)
            want = 0o700 if p.is_dir() else 0o600
            assert mode == want, f"{p} is {oct(mode)}, expected {oct(want)}"
            checked += 1
    assert checked >= 7
    report("isolation", private_paths_checked=checked, umask="000")


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_store_writable_by_others_is_refused(tmp_path, kind: str, mode: int) -> None:
    TierCache.open(config(tmp_path, "ns", (kind,)), block_bytes=BB).close()
    (tmp_path / kind).chmod(mode)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.path: .*writable by group or others"):
        TierCache.open(config(tmp_path, "ns", (kind,)), block_bytes=BB)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_store_owned_by_another_user_is_refused(tmp_path, kind: str) -> None:
    TierCache.open(config(tmp_path, "ns", (kind,)), block_bytes=BB).close()
    os.chown(tmp_path / kind, 54321, 54321)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.path: .*(owned by|belongs to) uid 54321"):
        TierCache.open(config(tmp_path, "ns", (kind,)), block_bytes=BB)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_nvme_file_owned_by_another_user_is_refused(tmp_path) -> None:
    TierCache.open(config(tmp_path, "ns", ("nvme",)), block_bytes=BB).close()
    os.chown(tmp_path / "nvme" / "slab", 54321, 54321)
    with pytest.raises(ConfigError, match=r"slab' is owned by uid 54321"):
        TierCache.open(config(tmp_path, "ns", ("nvme",)), block_bytes=BB)


# -- nothing from disk is unpickled or evaluated ----------------------------------------------------
_FORBIDDEN = {
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
    ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"), ("dill", "load"),
    ("dill", "loads"), ("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
    ("jsonpickle", "decode"),
}  # fmt: skip


def test_no_unpickling_or_eval_in_the_package() -> None:
    calls = 0
    for src in [
        *(REPO / "tiercache").rglob("*.py"),
        *(REPO / "tiers").rglob("*.py"),
        *(REPO / "policies").rglob("*.py"),
    ]:
        tree = ast.parse(src.read_text(), str(src))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            calls += 1
            f = node.func
            where = f"{src.relative_to(REPO)}:{node.lineno}"
            if isinstance(f, ast.Name):
                assert f.id not in ("eval", "exec", "__import__"), where
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                assert (f.value.id, f.attr) not in _FORBIDDEN, where
                if f.attr == "load" and f.value.id in ("np", "numpy"):
                    assert not any(k.arg == "allow_pickle" for k in node.keywords), where
    assert calls > 500


class _Plant:
    """A pickle that would create a marker file if anything ever unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_planted_payloads_never_run(tmp_path) -> None:
    import lmdb

    from tiercache.tiers.lmdb import layout as lmdb_tier

    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Plant(marker))
    root = tmp_path / "stores"
    root.mkdir(mode=0o700)
    with TierCache.open(config(root, "ns"), block_bytes=BB) as cache:
        cache.put([b"a" * 16], blocks([1], BB))
    # A pickle as the NVMe metadata: refused as not JSON (unreadable).
    meta = root / "nvme" / "meta.json"
    good_meta = meta.read_bytes()
    meta.write_bytes(payload)
    with pytest.raises(ConfigError, match=r"meta.json': unreadable tiercache metadata"):
        TierCache.open(config(root, "ns", ("nvme",)), block_bytes=BB)
    meta.write_bytes(b"__import__('os').system('touch %s')" % bytes(marker))
    with pytest.raises(ConfigError, match="unreadable tiercache metadata"):
        TierCache.open(config(root, "ns", ("nvme",)), block_bytes=BB)
    meta.write_bytes(good_meta)
    # A pickle as the LMDB metadata value and as a block payload under a real key.
    env = lmdb.open(str(root / "lmdb"), max_dbs=3, subdir=True)
    try:
        meta_db = env.open_db(lmdb_tier.META_DB)
        blocks_db = env.open_db(lmdb_tier.BLOCKS_DB)
        with env.begin(write=True) as txn:
            real_key = lmdb_tier.store_key(namespace_id("ns"), b"a" * 16)
            txn.put(real_key, payload.ljust(BB, b"\0"), db=blocks_db)
            good = txn.get(lmdb_tier.META_KEY, db=meta_db)
            txn.put(lmdb_tier.META_KEY, payload, db=meta_db)
    finally:
        env.close()
    with pytest.raises(ConfigError, match="unreadable tiercache metadata"):
        TierCache.open(config(root, "ns", ("lmdb",)), block_bytes=BB)
    env = lmdb.open(str(root / "lmdb"), max_dbs=3, subdir=True)
    try:
        meta_db = env.open_db(lmdb_tier.META_DB)  # outside the txn: it takes the writer lock
        with env.begin(write=True) as txn:
            txn.put(lmdb_tier.META_KEY, good, db=meta_db)
    finally:
        env.close()
    with TierCache.open(config(root, "ns", ("lmdb",)), block_bytes=BB) as cache:
        assert len(cache.get([b"a" * 16])) == 0  # never served: dropped at open or at read
        dropped = cache.tiers[-1].open_report["blocks_dropped"]
        assert cache.stats()["lmdb"]["errors"] + dropped == 1
    assert not marker.exists()


# -- crafted keys and namespaces stay inside the store ----------------------------------------------
def test_crafted_keys_and_namespaces_never_escape_the_store(tmp_path) -> None:
    root = tmp_path / "stores"
    root.mkdir(mode=0o700)
    outside = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    crafted = [
        b"../../etc/passwd",
        b"/" * 16,
        b"\0" * 16,
        b"..\\..\\x\\y\\zz.txt",
        b"%s%n%x%d%p......",
    ]
    assert all(len(k) == 16 for k in crafted)
    namespaces = ("../../../tmp/escape", "/etc", "a\0b")
    for ns in namespaces:
        with TierCache.open(config(root, ns), block_bytes=BB) as cache:
            assert cache.put(crafted, blocks(range(5), BB)) == 5
            assert torch.equal(cache.get(crafted), blocks(range(5), BB))
    after = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    names = {p.name for p in root.rglob("*")}
    store_names = {
        "nvme",
        "lmdb",
        "meta.json",
        "slab",
        "index",
        "index.img",
        "data.mdb",
        "lock.mdb",
    }
    # Outside the store: paths that appeared next to it, names inside it that no tier writes
    # (a crafted key or namespace turned into a file name), and the escape path itself.
    escaped = [p for p in (Path("/tmp/escape"),) if p.exists()]
    strays = sorted(set(after) - set(outside)) + sorted(names - store_names) + escaped
    report(
        "isolation",
        crafted_keys=len(crafted),
        crafted_namespaces=len(namespaces),
        files_outside=len(strays),
    )
    assert not strays, strays
    assert after == outside  # nor did anything outside the store go away
