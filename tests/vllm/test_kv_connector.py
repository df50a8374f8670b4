"""`TierCacheConnector` end to end on a real vLLM CPU engine (tiny random-weight Llama).

One baseline engine without a connector, then engines with the connector, each in a fresh
process, sharing persistent tiers (NVMe + LMDB) in a temporary directory:

- A (cold): greedy outputs equal the baseline; after vLLM's own prefix cache is reset, the
  prompts come back from tiercache (external hits) and the outputs still match.
- B (restart): a fresh process with the same config hits the persistent tiers for every
  prompt (`num_cached_tokens` > 0), outputs equal; B' is the same in multiprocess mode (on
  a copy of A's store, beside B).
- Keys carry everything that changes KV values (issue 14, item 4), beside B: an engine whose
  `hf_overrides` change the rope (its KV differs), on a copy of A's store, gets nothing from
  it, and its outputs equal a run without the connector with the same override; B, without
  the override, still hits.
- C (corrupted): bytes flipped inside every stored record of both persistent tiers. C1 in
  multiprocess mode: the worker's loads fail verification, vLLM recomputes (policy
  "recompute"). C2, beside C1 on a copy of the corrupted store, in process with vLLM's
  default policy ("fail") on purpose: the connector verifies persistent blocks before it
  reports them, so no request fails. Outputs equal the baseline and the errors are counted.

Tensor parallelism (TP=2) is test_tp_layout.py's: head shards across TP sizes, and
`tp_layout = "rank"` (each rank its own `tp{rank}of2` stores; restart; one rank's store
corrupted), whose engines run beside that module's TP=2 engines.

The checks are batched per engine process, and engines independent of each other run at
once, to keep the run short (vLLM takes ~12 s to import).
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

N_PROMPTS = 8  # conftest's llama_prompts
PROMPT_LEN = 200  # 6 full blocks of 32; the 7th holds the last prompt token
SHARED = 64  # two blocks common to all prompts
MAGIC = b"TCB\x01"
# Head shards per block (tp_layout "auto"): the tiny Llama's 2 KV heads, one shard each; a
# tier's blocks and counters are shards, so a block looked up is SHARDS hits of a tier.
SHARDS = 2


def _kv_config(root: Path, *, policy: str | None, tp_layout: str | None = None) -> dict[str, Any]:
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 8},
        {"kind": "lmdb", "path": str(root / "lmdb"), "blocks": 128, "compression": "none"},
    ]
    cfg: dict[str, Any] = {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": {"namespace": "e2e", "tiers": tiers}},
    }
    if tp_layout is not None:
        cfg["kv_connector_extra_config"]["tp_layout"] = tp_layout
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


def _errors(result: dict[str, Any]) -> int:
    return sum(
        int(t["errors"]) for store in result["stores"].values() for t in store["stats"].values()
    )


def _tier_hits(result: dict[str, Any], medium: str) -> int:
    return sum(int(s["stats"][medium]["hits"]) for s in result["stores"].values())


def corrupt_records(path: Path, *, payload: bool, round: int = 0) -> int:
    """Flip one byte in every tiercache block record found in the files under `path`.

    `payload=True` flips a byte inside the record's payload (NVMe slab: header and payload
    are adjacent); otherwise a byte of the header's write-sequence field, which lies inside
    an LMDB value (LMDB's own pages stay intact) and is covered by the checksum. Each `round`
    flips a different byte, so a second round never undoes the first.
    """
    if (path / "data.mdb").exists() and not payload:
        return _corrupt_lmdb_headers(path, round)
    flipped = 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        data = bytearray(f.read_bytes())
        at = data.find(MAGIC)
        while at >= 0 and at + 64 <= len(data):
            stored_len = struct.unpack_from("<I", data, at + 36)[0]
            pos = at + 64 + stored_len // 2 + round if payload else at + 41 + round
            if pos < len(data):
                data[pos] ^= 0xFF
                flipped += 1
            at = data.find(MAGIC, at + 64)
        f.write_bytes(bytes(data))
    return flipped


def _corrupt_lmdb_headers(path: Path, round: int) -> int:
    """Flip byte 41 + `round` (the write-sequence field, under the checksum) of every block
    header in an LMDB store, written back through LMDB: the values are damaged, LMDB's own
    pages stay intact (flipping bytes found in data.mdb could hit a page reused as a branch,
    whose unused space still holds old headers)."""
    from tiercache.tiers.lmdb import open_store

    flipped = 0
    with open_store(path, write=True) as h, h.env.begin(write=True) as txn:
        cur = txn.cursor(db=h.heads)
        changed = []
        for k, v in cur:
            if v[:4] == MAGIC and len(v) >= 64:
                b = bytearray(v)
                b[41 + round] ^= 0xFF
                changed.append((bytes(k), bytes(b)))
        for k, v in changed:
            txn.put(k, v, db=h.heads)
            flipped += 1
    return flipped


@pytest.fixture(scope="module")
def prompts(llama_prompts: list[list[int]]) -> list[list[int]]:
    """conftest's prompt set: N_PROMPTS x PROMPT_LEN tokens, the first SHARED common."""
    assert [len(p) for p in llama_prompts] == [PROMPT_LEN] * N_PROMPTS
    assert len({tuple(p[:SHARED]) for p in llama_prompts}) == 1
    return llama_prompts


@pytest.fixture(scope="module")
def baseline(llama_outputs: list[list[int]]) -> list[list[int]]:
    """Their outputs without a connector (conftest: one engine run per session)."""
    return llama_outputs


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiercache-store")


def _spec(model: Path, kv: dict[str, Any], batches: list[dict[str, Any]], **kw: Any) -> dict:
    # vLLM's KV events on: the connector builds the events these tests count only then.
    return {
        "model": str(model),
        "kv_transfer_config": kv,
        "batches": batches,
        "kv_events": True,
        **kw,
    }


@pytest.fixture(scope="module")
def run_a(
    engine: ModuleType, tiny_llama: Path, prompts: list[list[int]], store_root: Path
) -> dict[str, Any]:
    """A: a cold engine; vLLM's prefix cache is reset after the first batch, so only
    tiercache can serve the second."""
    kv = _kv_config(store_root, policy="recompute")
    batches = [
        {"prompts": prompts, "max_tokens": 16, "reset_prefix_cache": True},
        {"prompts": prompts, "max_tokens": 16},
    ]
    return engine.run_in_subprocess(_spec(tiny_llama, kv, batches))


ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


@pytest.fixture(scope="module")
def run_b(
    engine: ModuleType,
    tiny_llama: Path,
    prompts: list[list[int]],
    store_root: Path,
    run_a: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """At the same time (independent engines, each on a store of its own: together they
    take less than one after the other), fresh processes on A's store or on copies of it
    taken before any of them ran (an engine's own stores must not serve another):
    - B, a restart on A's store, in process; B', the same in multiprocess mode (a copy);
    - the rope override with the connector (a copy), and without a connector."""
    one = [{"prompts": prompts, "max_tokens": 16}]
    copies = [tmp_path_factory.mktemp(f"tiercache-store-{n}") / "store" for n in ("mp", "rope")]
    for copy in copies:
        shutil.copytree(store_root, copy)
    mp, rope = (_kv_config(copy, policy="recompute") for copy in copies)
    local, remote, rope, rope_base = engine.run_together(
        [
            _spec(tiny_llama, _kv_config(store_root, policy="recompute"), one),
            _spec(tiny_llama, mp, one, multiprocessing=True),
            _spec(tiny_llama, rope, one, hf_overrides=ROPE),
            {"model": str(tiny_llama), "batches": one, "hf_overrides": ROPE},
        ]
    )
    return local, remote, rope, rope_base


@pytest.fixture(scope="module")
def run_c(
    engine: ModuleType,
    tiny_llama: Path,
    prompts: list[list[int]],
    store_root: Path,
    run_b: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], dict[str, Any], tuple[int, int]]:
    """C: the store corrupted, then at the same time: C1 multiprocess (the worker finds the
    bad blocks at load and reports them; vLLM recomputes), and on a copy of the corrupted
    store (C1's recomputed blocks, stored again, must not heal it) C2 in process with vLLM's
    default policy "fail" (the scheduler finds them before it reports a hit)."""
    one = [{"prompts": prompts, "max_tokens": 16}]
    flipped = (
        corrupt_records(store_root / "nvme", payload=True),
        corrupt_records(store_root / "lmdb", payload=False),
    )
    copy = tmp_path_factory.mktemp("tiercache-store-corrupted") / "store"
    shutil.copytree(store_root, copy)
    kv = _kv_config(store_root, policy="recompute")
    remote, local = engine.run_together(
        [
            _spec(tiny_llama, kv, one, multiprocessing=True),
            _spec(tiny_llama, _kv_config(copy, policy=None), one),
        ]
    )
    return remote, local, flipped


def test_a_cold_engine_matches_baseline_and_hits_after_reset(
    run_a: dict[str, Any], baseline: list[list[int]]
) -> None:
    first, second = run_a["batches"]
    assert first["outputs"] == baseline
    assert second["outputs"] == baseline
    # Cold: nothing external; the shared prefix comes from vLLM's own cache.
    assert first["num_cached_tokens"] == [0] + [SHARED] * (N_PROMPTS - 1)
    # After the reset every prompt's first 6 blocks come back from tiercache.
    assert second["num_cached_tokens"] == [192] * N_PROMPTS
    (store,) = run_a["stores"].values()
    c = store["counters"]
    assert c["stored_blocks"] == 2 + N_PROMPTS * 4  # the distinct full blocks of the prompts
    assert c["loaded_blocks"] >= 2 + N_PROMPTS * 4
    assert c.get("load_error_blocks", 0) == 0
    assert _errors(run_a) == 0
    assert store["stats"]["nvme"]["used_blocks"] > 0  # the small CPU tier demoted
    # vLLM received the cache's events, the tier as medium: stores into the CPU tier,
    # demotions (removed from cpu, stored in nvme).
    ev = run_a["events"]
    # Every block was stored somewhere: into the cpu tier, or around it into nvme/lmdb while
    # its 8 blocks were held by stores in flight (write-around).
    stored = sum(n for kind, n in ev.items() if kind.startswith("BlockStored:"))
    assert stored >= 2 + N_PROMPTS * 4 and ev["BlockStored:CPU"] > 0
    # The cpu tier holds 8 blocks: every block stored into it past 8 made room by a removal
    # (a demotion, or a drop of a block already written through). How many went around it
    # depends on timing, so whether it overflowed at all does too.
    assert ev.get("BlockRemoved:CPU", 0) >= ev["BlockStored:CPU"] - 8
    assert ev["BlockStored:STORAGE"] > 0  # nvme and lmdb: vLLM's medium for both


def test_b_restart_hits_persistent_tiers(
    run_b: tuple[dict[str, Any], ...], baseline: list[list[int]]
) -> None:
    local, remote, _, _ = run_b
    (batch,) = local["batches"]
    assert batch["outputs"] == baseline
    assert batch["num_cached_tokens"] == [192] * N_PROMPTS
    assert _tier_hits(local, "nvme") > 0 and _tier_hits(local, "lmdb") > 0
    (store,) = local["stores"].values()
    # "recompute": the worker loaded the persistent blocks straight into the engine,
    # asynchronously (issue 35); the scheduler did not read them first. vLLM caches an
    # asynchronously loaded block only once its load ends, so each of the batch's prompts,
    # all scheduled in its first step, asks for and loads its 6 full blocks, the 2 shared
    # ones too (with the verifying read the first prompt's were in vLLM's prefix cache at
    # once: 2 + 8 x 4). None failed.
    assert "verified_blocks" not in store["counters"]
    asked = N_PROMPTS * 6
    assert store["counters"]["loaded_blocks"] == asked
    assert _errors(local) == 0
    # One block looked up once is one hit per shard (SHARDS), in the tier that served it:
    # loading it counts nothing more (issue 14). A tier counts a miss for each block asked
    # of it that it did not serve (found below, or nowhere): every block reaches the first
    # tier once, and the last one misses none.
    tiers = list(store["stats"].values())  # fastest first
    shards = asked * SHARDS
    assert sum(int(t["hits"]) for t in tiers) == shards, store
    assert tiers[0]["hits"] + tiers[0]["misses"] == shards and tiers[-1]["misses"] == 0, store
    assert store["counters"]["lookup_hit_blocks"] == asked, store
    # What the persistent tiers recovered at start-up is announced to vLLM as stored once a
    # lookup describes it (docs/events.md): every prompt hit them here.
    assert local["events"]["BlockStored:STORAGE"] > 0
    # Multiprocess mode: the scheduler knows the worker's keys from the handshake.
    assert remote["batches"][0]["outputs"] == baseline
    assert remote["batches"][0]["num_cached_tokens"] == [192] * N_PROMPTS


def test_b_an_override_that_changes_kv_never_hits_another_engines_store(
    run_a: dict[str, Any], run_b: tuple[dict[str, Any], ...], baseline: list[list[int]]
) -> None:
    """Issue 14, item 4, through TierCacheConnector (vLLM's OffloadingConnector:
    test_offloading_spec.py): the override engine misses A's blocks, the others hit them."""
    local, _, rope, rope_base = run_b
    want = rope_base["batches"][0]["outputs"]
    plain = run_a["batches"][0]["outputs"]
    assert want != plain  # the override changes the model's outputs (and so its KV)
    (batch,) = rope["batches"]
    # Before the digest: every loadable token came from the other engine's store, and the
    # outputs differed from `want`. Now only vLLM's own cache serves: the shared prefix,
    # computed by the first prompt of the batch (as in A's cold batch); A's blocks, which
    # the copy holds in its persistent tiers only, are never hit.
    assert batch["num_cached_tokens"] == [0] + [SHARED] * (N_PROMPTS - 1)
    assert _tier_hits(rope, "nvme") == 0 and _tier_hits(rope, "lmdb") == 0, rope["stores"]
    assert batch["outputs"] == want
    # B, without the override, on the store the copy was taken from: every block hits.
    assert local["batches"][0]["num_cached_tokens"] == [192] * N_PROMPTS
    assert local["batches"][0]["outputs"] == plain


def test_c_corrupted_store_recomputes_and_counts_errors(
    run_c: tuple[dict[str, Any], dict[str, Any], tuple[int, int]], baseline: list[list[int]]
) -> None:
    remote, local, flipped = run_c
    assert all(n > 0 for n in flipped)
    # C1: hits were reported from the index, the worker's asynchronous loads failed
    # verification, vLLM recomputed those blocks: same tokens, fewer cached ones.
    assert remote["batches"][0]["outputs"] == baseline
    assert sum(remote["batches"][0]["num_cached_tokens"]) < 192 * N_PROMPTS
    # C2: caught before any hit was reported, with vLLM's default policy ("fail").
    (batch,) = local["batches"]
    assert batch["outputs"] == baseline
    (store,) = local["stores"].values()
    assert store["counters"].get("verify_errors", 0) > 0
    assert _errors(local) > 0
    assert store["counters"].get("load_error_blocks", 0) == 0
    assert sum(batch["num_cached_tokens"]) < 192 * N_PROMPTS
