"""Head shards end to end: KV stored under one tensor-parallel size, loaded under another
(issue 32, docs/tp-layout.md), through the KV connector on real vLLM CPU engines.

A tiny random-weight Llama with 4 KV heads (fp32), so TP 1 and TP 2 both serve it; its
default ``max_tp`` is 4 (the largest power of two dividing 4, at most 8): 4 head shards per
block, 2 per TP=2 rank. Tiers: CPU (per process) + LMDB (one store shared by every rank of
every engine, at the configured path). Every engine runs in a fresh process, in this order,
on one store:

- E1, TP=2: stores P1, then R. This process reads the store's keys in between, and once E1
  is done deletes one of R's records (one head shard of one block).
- E2, TP=1, multiprocess: a fresh engine loads P1 (TP=2 -> TP=1), then stores P2.
- E3 (TP=1, in process) and E4 (TP=2) at the same time. First each loads as a fresh engine:
  E3 P1 (TP=2 -> TP=1 in process), E4 P1 + P2 (P1: the same-TP restart TP=2 -> TP=2; P2:
  TP=1 -> TP=2), then E4 R: its scheduler, answering for both ranks, must miss the block
  without its shard (and the rest of that prompt). Then each stores its own set (E3 Q1,
  E4 Q2), waits until its write-through copies reached LMDB, says so (a file), and once the
  other said so, loads the other's set: live sharing, each hitting what the other stored
  after both started.
- The TP=1 engines look the store up two ways: E2's scheduler (its own process) from its
  index of the worker's keys and read-only probes of LMDB; E3's in its worker's store.

Every engine's outputs equal the engine of the same TP size without a connector (the same
batches), and every load (but R's) hits exactly the loadable tokens of each prompt (the full
blocks before the block holding its last token: every shard of every block is in the store,
which evicts nothing): the prompts share no prefix, so every cached token of a batch came
from tiercache, not from vLLM's own prefix cache.

Settings: ``"heads"`` with a ``max_tp`` the TP size does not divide is refused when the
engine starts, naming the setting.

``"tp_layout": "rank"`` (one store per rank, the layout before head shards), on a store of its
own (CPU + NVMe + LMDB, each persistent path split into ``tp{r}of2``): RA (TP=2, telemetry
and Prometheus on) stores Q1, then after a prefix-cache reset loads it on both ranks; RB, a
fresh TP=2 engine, hits both ranks' persistent tiers; RC, fresh once rank 1's persistent
stores are corrupted, recomputes what rank 1 cannot load. Outputs equal TP=2 without a
connector (the phase A baseline).

NVMe alone (CPU + NVMe, no shared tier; a store of its own): N1 (TP=1, multiprocess) stores
P1; N2, a fresh TP=2 engine, loads P1 (TP=1 -> TP=2: rank 1 reads its shards in instance
0, read-only) and stores P2; N3, a fresh TP=1 engine (multiprocess), loads P2 (TP=2 ->
TP=1: shards 2..3 in instance 1). Outputs equal the same TP size without a connector.

Timing: each TP=2 engine start costs tens of seconds on two cores, so the engines are shared
by the tests and run together where the order allows, in three phases: the two baselines
with E1 (and RA, N1); E2 with the refused engine (a store of its own), RB and N2; E3 with E4
(and RC, N3). The refused engine, RA to RC and N1 to N3 run only when their tests do: not
under ``-m every_vllm``. N1 to N3 add about 50 s to the file (2026-11-27, 2-core VM under
load: 205 s without them, 258 s with).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.ports import free_port
from tiercache.telemetry import read_stats

pytest.importorskip("vllm")

BLOCK = 32
PROMPT_LEN = 200  # 6 full blocks of 32; the 7th holds the last prompt token
N_PROMPTS = 4
TOKENS = 8
KV_HEADS = 4
SHARDS = 4  # head shards per block: the default max_tp (largest power of 2 dividing 4)

# Baseline batches (no connector), the same composition as the connector engines' batches:
# greedy outputs are compared batch by batch.
BASELINE_BATCHES = ("p1", "p2", "p1+p2", "q1", "q2", "r")


def _kv(root: Path, **extra: Any) -> dict[str, Any]:
    """The connector's kv_transfer_config: CPU tier + LMDB under `root`; `extra` goes next
    to "config" in kv_connector_extra_config (tp_layout, max_tp)."""
    tiers = [
        {"kind": "cpu", "blocks": 64},
        # Room for every shard of every prompt set (4 sets x 24 blocks x 4 shards) whatever
        # a block counts as: nothing is evicted, so a miss is never the capacity's.
        {"kind": "lmdb", "path": str(root / "lmdb"), "blocks": 2048, "compression": "none"},
    ]
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        # A block a scheduler promised and a worker could not load is recomputed (same
        # tokens): the tests then see it as fewer hits and as load_error_blocks.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "config": {"namespace": "tp-layout", "tiers": tiers},
            **extra,
        },
    }


def _nvme_kv(root: Path) -> dict[str, Any]:
    """CPU + NVMe only (no shared tier), under `root`: what a fresh engine hits came from the
    NVMe instances on this host, its own or, read-only, another rank's (the siblings)."""
    kv = _kv(root)
    kv["kv_connector_extra_config"]["config"]["tiers"] = [
        {"kind": "cpu", "blocks": 64},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 256},
    ]
    return kv


def _rank_kv(root: Path, *, telemetry: bool = False) -> dict[str, Any]:
    """tp_layout "rank": CPU + NVMe + LMDB under `root`, each rank its own store (its own
    ``tp{r}of2`` under every persistent path); with `telemetry`, each rank its own telemetry
    directory and Prometheus port."""
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 8},
        {"kind": "lmdb", "path": str(root / "lmdb"), "blocks": 128, "compression": "none"},
    ]
    config: dict[str, Any] = {"namespace": "tp-rank", "tiers": tiers}
    if telemetry:
        config["telemetry"] = {
            "dir": str(root / "telemetry"),
            "prometheus": f"127.0.0.1:{free_port(also=1)}",
        }
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": config, "tp_layout": "rank"},
    }


# The tests whose engines run only when one of them is selected (under `-m every_vllm` they
# are not): the settings ("heads" refused) and tp_layout "rank".
SETTINGS_TESTS = ("test_heads_layout_",)
RANK_TESTS = ("test_rank_layout_",)
NVME_TESTS = ("test_nvme_alone_",)
RANK_SET = "q1"  # the prompt set of RA, RB and RC


def _selected(request: pytest.FixtureRequest, prefixes: tuple[str, ...]) -> bool:
    return any(item.name.startswith(prefixes) for item in request.session.items)


def loadable(prompts: list[list[int]]) -> int:
    """Tokens a connector can serve: the full blocks before each prompt's last token's block."""
    return sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


def _snapshots(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every store snapshot of an engine: its process's (TP=1) and each rank's (TP > 1)."""
    out = list(result["stores"].values())
    for rank in result.get("rank_stores", []):
        out += list(rank.values())
    return out


def _counter(result: dict[str, Any], name: str) -> int:
    return sum(int(s["counters"].get(name, 0)) for s in _snapshots(result))


def _errors(result: dict[str, Any]) -> int:
    return sum(int(t["errors"]) for s in _snapshots(result) for t in s["stats"].values())


def _namespaces(result: dict[str, Any]) -> set[str]:
    names = set(result["stores"])
    for rank in result.get("rank_stores", []):
        names |= set(rank)
    return names


def _facts(result: dict[str, Any]) -> dict[str, Any]:
    """What a failed assertion shows: hits per batch, the counters, per-tier stats."""
    return {
        "cached": [b["num_cached_tokens"] for b in result["batches"]],
        "init_s": result["init_s"],
        "stores": [{"counters": s["counters"], "stats": s["stats"]} for s in _snapshots(result)],
    }


def _report(name: str, result: dict[str, Any]) -> None:
    """One line per engine in the captured output (pytest -rA, or a failure, shows it): its
    start-up and batch times, each batch's cached tokens, and per store (TP > 1: per rank)
    the blocks it stored and loaded."""
    batches = [(round(b["wall_s"], 1), sum(b["num_cached_tokens"])) for b in result["batches"]]
    names = ("stored_blocks", "loaded_blocks", "load_error_blocks")
    line = {
        "engine": name,
        "import_s": round(result["import_s"], 1),
        "init_s": round(result["init_s"], 1),
        "batches (wall_s, cached)": batches,
        "stores": [{n: s["counters"].get(n, 0) for n in names} for s in _snapshots(result)],
    }
    print(json.dumps(line))


def assert_loads(
    result: dict[str, Any], batch: int, prompts: list[list[int]], want: list[list[int]]
) -> None:
    """Batch `batch` of `result` served `prompts`: outputs equal `want` (the same TP size
    without a connector), every prompt hit exactly its loadable tokens, no load failed."""
    got = result["batches"][batch]
    assert got["outputs"] == want, _facts(result)
    assert got["num_cached_tokens"] == [loadable([p]) for p in prompts], _facts(result)
    assert _counter(result, "load_error_blocks") == 0, _facts(result)
    assert _errors(result) == 0, _facts(result)


def _tick() -> dict[str, Any]:
    """A batch of one 1-token prompt (nothing to look up or store) that first waits until the
    engine's write-through copies reached LMDB: the stores of the batch before it, whose
    `reset_prefix_cache` waited for the connector's saves into the CPU tier."""
    return {"prompts": [[3]], "max_tokens": 1, "settle_through": True}


@pytest.fixture(scope="module")
def model(engine: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 4 KV heads (4 attention heads of 32: hidden 128), fp32."""
    return engine.write_tiny_llama(tmp_path_factory.mktemp("llama-4kv"), heads=4, kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def sets(engine: ModuleType) -> dict[str, list[list[int]]]:
    """Five prompt sets, no prefix shared within or across them."""
    out = {
        name: engine.make_prompts(N_PROMPTS, PROMPT_LEN, seed=320 + i)
        for i, name in enumerate(("p1", "p2", "q1", "q2", "r"))
    }
    out["p1+p2"] = out["p1"] + out["p2"]
    return out


def _spec(model: Path, kv: dict[str, Any] | None, batches: list[dict[str, Any]], **kw: Any):
    # vLLM's KV events on: the connector builds the events these tests count only then.
    return {
        "model": str(model),
        "kv_transfer_config": kv,
        "batches": batches,
        "kv_events": True,
        **kw,
    }


def _one(prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": TOKENS, **kw}


@contextlib.contextmanager
def _together(engine: ModuleType, *specs: dict[str, Any]) -> Iterator[list[Any]]:
    """Engines started at once (each in its own process); every one left is killed on exit
    (one that failed must not leave the other waiting for its file for minutes)."""
    running = [engine.start_in_subprocess(s) for s in specs]
    try:
        yield running
    finally:
        for r in running:
            r.kill()


def _results(running: list[Any], timeout: float = 600) -> list[dict[str, Any]]:
    """The results of engines started together, in order; the first failure raises at once
    (its partner may be waiting for a file the failed one never touches)."""
    done: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    while len(done) < len(running):
        for i, r in enumerate(running):
            if i not in done and r.proc.poll() is not None:
                done[i] = r.result(0)  # raises with the engine's errors if it failed
        if time.monotonic() > end:
            raise TimeoutError(f"engines {sorted(set(range(len(running))) - set(done))} ran on")
        time.sleep(0.1)
    return [done[i] for i in range(len(running))]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store (E1 to E4)."""
    return tmp_path_factory.mktemp("tp-layout-store")


@pytest.fixture(scope="module")
def nvme_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVMe-only store (N1 to N3)."""
    return tmp_path_factory.mktemp("tp-layout-nvme")


@pytest.fixture(scope="module")
def rank_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp_layout "rank"'s store (RA to RC)."""
    return tmp_path_factory.mktemp("tp-layout-rank")


@dataclass(frozen=True)
class PhaseA:
    """What `phase_a` ran: per TP size each baseline batch's outputs, E1's result, the LMDB
    records E1 stored for P1 and for R, the one R record then deleted, and RA's result (None
    when its test does not run)."""

    baselines: dict[int, dict[str, list[list[int]]]]
    e1: dict[str, Any]
    p1_records: int
    r_records: int
    deleted: int
    rank_a: dict[str, Any] | None = None
    nvme_1: dict[str, Any] | None = None


def _lmdb_keys(path: Path) -> set[bytes]:
    """The store keys of every block record (header or payload) in the LMDB store."""
    from tiercache.tiers.lmdb import open_store
    from tiercache.tiers.lmdb.offline import iter_entries

    with open_store(path) as h:
        return {key for key, _, _ in iter_entries(h)}


@pytest.fixture(scope="module")
def phase_a(
    engine: ModuleType,
    model: Path,
    sets: dict[str, list[list[int]]],
    root: Path,
    rank_root: Path,
    nvme_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> PhaseA:
    """At the same time: the baselines (TP 1 and 2 without a connector, BASELINE_BATCHES)
    and E1 (TP=2, default tp_layout "auto": head shards), which stores P1, then R; and, if
    its test runs, RA (tp_layout "rank", telemetry on): RANK_SET, then after a prefix-cache
    reset RANK_SET again (served by tiercache).

    Between the two, once P1's write-through copies reached LMDB, this process reads the
    store's keys: those E1 adds afterwards are R's. Once E1 is done, one of R's records (one
    head shard of one block) is deleted: a block missing one shard (E4 loads R).

    With them, if a test of NVME_TESTS runs: N1, TP=1 (multiprocess) on a CPU + NVMe store
    of its own, stores P1."""
    flags = tmp_path_factory.mktemp("tp-layout-e1")
    p1_done, go_on = flags / "p1-stored", flags / "go-on"
    batches = [_one(sets[name]) for name in BASELINE_BATCHES]
    # No prefix caching: every baseline batch computes all its tokens (P1 + P2 would
    # otherwise reuse P1's and P2's blocks from the batches before it).
    specs = [
        _spec(model, None, batches, tensor_parallel_size=tp, enable_prefix_caching=False)
        for tp in (1, 2)
    ]
    e1 = [
        _one(sets["p1"], reset_prefix_cache=True),
        {**_tick(), "touch": str(p1_done)},
        _one(sets["r"], wait_for=str(go_on), reset_prefix_cache=True),
        _tick(),
    ]
    specs.append(_spec(model, _kv(root), e1, tensor_parallel_size=2))
    rank = _selected(request, RANK_TESTS)
    if rank:
        one = _one(sets[RANK_SET])
        ra = [{**one, "reset_prefix_cache": True}, one]
        specs.append(_spec(model, _rank_kv(rank_root, telemetry=True), ra, tensor_parallel_size=2))
    nvme = _selected(request, NVME_TESTS)
    if nvme:  # N1, TP=1 (multiprocess) on the NVMe-only store: stores P1
        n1 = [_one(sets["p1"], reset_prefix_cache=True), _tick()]
        specs.append(_spec(model, _nvme_kv(nvme_root), n1, multiprocessing=True))
    with _together(engine, *specs) as running:
        running[2].wait_for(p1_done, timeout=600)
        p1_keys = _lmdb_keys(root / "lmdb")
        go_on.touch()
        results = _results(running)
    bases, e1_result = results[:2], results[2]
    r_keys = sorted(_lmdb_keys(root / "lmdb") - p1_keys)
    from tiercache.tiers.lmdb import delete_entries, open_store

    with open_store(root / "lmdb", write=True) as h:
        deleted = delete_entries(h, r_keys[:1])
    out = {}
    for tp, base in zip((1, 2), bases, strict=True):
        outputs = [b["outputs"] for b in base["batches"]]
        out[tp] = dict(zip(BASELINE_BATCHES, outputs, strict=True))
        # The model is a useful oracle only if different prompts give different tokens.
        assert len({tuple(o) for o in out[tp]["p1+p2"]}) == 2 * N_PROMPTS
        _report(f"baseline TP={tp}", base)
    _report("E1 (TP=2)", e1_result)
    rank_a = results[3] if rank else None
    if rank_a is not None:
        _report("RA (TP=2, rank)", rank_a)
    nvme_1 = results[-1] if nvme else None
    if nvme_1 is not None:
        _report("N1 (TP=1, NVMe only)", nvme_1)
    return PhaseA(out, e1_result, len(p1_keys), len(r_keys), deleted, rank_a, nvme_1)


@pytest.fixture(scope="module")
def baselines(phase_a: PhaseA) -> dict[int, dict[str, list[list[int]]]]:
    """Per TP size (1, 2), each batch's outputs without a connector (BASELINE_BATCHES)."""
    return phase_a.baselines


@pytest.fixture(scope="module")
def e1(phase_a: PhaseA) -> dict[str, Any]:
    return phase_a.e1


@dataclass(frozen=True)
class PhaseB:
    """What `phase_b` ran: E2, and (when their tests run) the refused engine's error ("" if
    it started) and RB's result."""

    e2: dict[str, Any]
    refused_error: str = ""
    rank_b: dict[str, Any] | None = None
    nvme_2: dict[str, Any] | None = None


@pytest.fixture(scope="module")
def phase_b(
    engine: ModuleType,
    model: Path,
    sets: dict[str, list[list[int]]],
    root: Path,
    rank_root: Path,
    nvme_root: Path,
    phase_a: PhaseA,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> PhaseB:
    """At the same time, once E1 (and RA) are done:
    - E2, TP=1 in vLLM's multiprocess mode, fresh on E1's store: loads P1, then stores P2;
    - on a store of its own, a TP=2 engine with tp_layout "heads" and max_tp 1 (2 does not
      divide 1), which must not start; only if a test of SETTINGS_TESTS is selected;
    - RB, a fresh TP=2 engine on RA's store (tp_layout "rank"): RANK_SET; only if a test of
      RANK_TESTS is selected;
    - N2, a fresh TP=2 engine on N1's NVMe-only store: loads P1 (TP=1 -> TP=2: rank 1's
      shards sit in instance 0, rank 0's), then stores P2; only if a test of NVME_TESTS is
      selected."""
    specs = [_spec(model, _kv(root), [_one(sets["p1"]), _one(sets["p2"])], multiprocessing=True)]
    refused = _selected(request, SETTINGS_TESTS)
    if refused:
        heads_root = tmp_path_factory.mktemp("tp-layout-heads")
        heads_kv = _kv(heads_root, tp_layout="heads", max_tp=1)
        specs.append(_spec(model, heads_kv, [_one(sets["p1"])], tensor_parallel_size=2))
    rank = _selected(request, RANK_TESTS)
    if rank:
        rb = [_one(sets[RANK_SET])]
        specs.append(_spec(model, _rank_kv(rank_root), rb, tensor_parallel_size=2))
    nvme = phase_a.nvme_1 is not None
    if nvme:
        n2 = [_one(sets["p1"]), _one(sets["p2"], reset_prefix_cache=True), _tick()]
        specs.append(_spec(model, _nvme_kv(nvme_root), n2, tensor_parallel_size=2))
    error = ""
    with _together(engine, *specs) as running:
        if refused:
            try:
                running[1].result(600)
            except RuntimeError as exc:
                error = str(exc)
        results = _results([r for i, r in enumerate(running) if not (refused and i == 1)])
    e2_result = results[0]
    rank_b = results[1] if rank else None
    nvme_2 = results[-1] if nvme else None
    _report("E2 (TP=1, multiprocess)", e2_result)
    if rank_b is not None:
        _report("RB (TP=2, rank)", rank_b)
    if nvme_2 is not None:
        _report("N2 (TP=2, NVMe only)", nvme_2)
    return PhaseB(e2_result, error, rank_b, nvme_2)


@pytest.fixture(scope="module")
def e2(phase_b: PhaseB) -> dict[str, Any]:
    return phase_b.e2


# The batches of E3 and E4 that store their own set, and that load the other's.
STORE = {"e3": 1, "e4": 2}
LIVE = {"e3": 3, "e4": 4}


@dataclass(frozen=True)
class PhaseC:
    """What `phase_c` ran: E3, E4, and RC's result (None when its test does not run)."""

    e3: dict[str, Any]
    e4: dict[str, Any]
    rank_c: dict[str, Any] | None = None
    nvme_3: dict[str, Any] | None = None


@pytest.fixture(scope="module")
def phase_c(
    engine: ModuleType,
    model: Path,
    sets: dict[str, list[list[int]]],
    root: Path,
    rank_root: Path,
    nvme_root: Path,
    phase_b: PhaseB,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    kv_connector_module: ModuleType,
) -> PhaseC:
    """E3 (TP=1, in process) and E4 (TP=2) at the same time on E1's and E2's store.

    Each: batch 0 loads as a fresh engine (E3 P1, E4 P1 + P2; then E4 R, one block of which
    misses a shard); batch STORE stores its own set (E3 Q1, E4 Q2) and resets vLLM's prefix
    cache once the connector's saves are done; the next batch waits for its write-through
    copies to reach LMDB, then touches its file; batch LIVE waits for the other's file and
    loads the other's set.

    With them, if its test runs: RC, a fresh TP=2 engine on RA's store once RB is done and
    rank 1's persistent stores (NVMe payloads, LMDB headers) are corrupted: RANK_SET.

    And, if N2 ran: N3, a fresh TP=1 engine (multiprocess) on the NVMe-only store: P2
    (TP=2 -> TP=1: shards 2..3 sit in instance 1, which it reads read-only)."""
    flags = tmp_path_factory.mktemp("tp-layout-flags")
    e3_done, e4_done = flags / "e3-stored", flags / "e4-stored"
    e3 = [
        _one(sets["p1"]),
        _one(sets["q1"], reset_prefix_cache=True),
        {**_tick(), "touch": str(e3_done)},
        _one(sets["q2"], wait_for=str(e4_done)),
    ]
    e4 = [
        _one(sets["p1+p2"]),
        _one(sets["r"]),
        _one(sets["q2"], reset_prefix_cache=True),
        {**_tick(), "touch": str(e4_done)},
        _one(sets["q1"], wait_for=str(e3_done)),
    ]
    specs = [
        _spec(model, _kv(root), e3),
        _spec(model, _kv(root), e4, tensor_parallel_size=2),
    ]
    rank = _selected(request, RANK_TESTS)
    if rank:
        corrupt = kv_connector_module.corrupt_records
        for tier, payload in (("nvme", True), ("lmdb", False)):
            assert corrupt(rank_root / tier / "tp1of2", payload=payload) > 0
        rc = [_one(sets[RANK_SET])]
        specs.append(_spec(model, _rank_kv(rank_root), rc, tensor_parallel_size=2))
    nvme = phase_b.nvme_2 is not None
    if nvme:
        n3 = [_one(sets["p2"])]
        specs.append(_spec(model, _nvme_kv(nvme_root), n3, multiprocessing=True))
    with _together(engine, *specs) as running:
        results = _results(running)
    _report("E3 (TP=1, in process)", results[0])
    _report("E4 (TP=2)", results[1])
    rank_c = results[2] if rank else None
    if rank_c is not None:
        _report("RC (TP=2, rank, rank 1 corrupted)", rank_c)
    nvme_3 = results[-1] if nvme else None
    if nvme_3 is not None:
        _report("N3 (TP=1, NVMe only)", nvme_3)
    return PhaseC(results[0], results[1], rank_c, nvme_3)


@pytest.fixture(scope="module")
def pair(phase_c: PhaseC) -> tuple[dict[str, Any], dict[str, Any]]:
    """E3 and E4 (`phase_c`)."""
    return phase_c.e3, phase_c.e4


def test_tp2_stores_tp1_loads_in_multiprocess_mode(
    e1: dict[str, Any],
    e2: dict[str, Any],
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
    root: Path,
) -> None:
    assert e1["batches"][0]["outputs"] == baselines[2]["p1"], _facts(e1)
    assert _counter(e1, "stored_blocks") > 0, _facts(e1)
    # Head shards: both ranks share the one store at the configured path (no tp{r}of{n}).
    assert (root / "lmdb" / "data.mdb").is_file()
    assert not list((root / "lmdb").glob("tp*of*")), sorted((root / "lmdb").iterdir())
    # The namespace names no TP size: both ranks and the TP=1 engine use the same one.
    assert len(_namespaces(e1)) == 1 and _namespaces(e1) == _namespaces(e2), (
        _namespaces(e1),
        _namespaces(e2),
    )
    assert_loads(e2, 0, sets["p1"], baselines[1]["p1"])
    assert e2["batches"][1]["outputs"] == baselines[1]["p2"]


def test_tp2_stores_tp1_loads_in_process(
    pair: tuple[dict[str, Any], dict[str, Any]],
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    e3, _ = pair
    assert_loads(e3, 0, sets["p1"], baselines[1]["p1"])


def test_tp1_stores_tp2_loads_and_same_tp_restart_hits(
    pair: tuple[dict[str, Any], dict[str, Any]],
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    """E4's first batch: P1 (stored by E1, TP=2: the same-TP restart) and P2 (stored by E2,
    TP=1), each prompt exactly its loadable tokens."""
    _, e4 = pair
    assert_loads(e4, 0, sets["p1+p2"], baselines[2]["p1+p2"])
    cached = e4["batches"][0]["num_cached_tokens"]
    same_tp, other_tp = sum(cached[:N_PROMPTS]), sum(cached[N_PROMPTS:])
    assert (same_tp, other_tp) == (loadable(sets["p1"]), loadable(sets["p2"])), _facts(e4)


def test_tp1_and_tp2_engines_share_one_lmdb_live(
    pair: tuple[dict[str, Any], dict[str, Any]],
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    e3, e4 = pair
    assert e3["batches"][STORE["e3"]]["outputs"] == baselines[1]["q1"]
    assert e4["batches"][STORE["e4"]]["outputs"] == baselines[2]["q2"]
    assert_loads(e3, LIVE["e3"], sets["q2"], baselines[1]["q2"])  # what the TP=2 engine stored
    assert_loads(e4, LIVE["e4"], sets["q1"], baselines[2]["q1"])  # what the TP=1 engine stored


def test_heads_layout_refuses_a_tp_size_not_dividing_max_tp(
    phase_b: PhaseB,
) -> None:
    error = phase_b.refused_error
    assert error, "a TP=2 engine started with tp_layout 'heads' and max_tp 1"
    assert "ConfigError" in error and ("max_tp" in error or "tp_layout" in error), error[-3000:]


def test_tp2_stores_each_head_shard_once(phase_a: PhaseA) -> None:
    """E1's two ranks wrote every block of P1 and of R as its 4 head shards (max_tp 4: one
    KV head each), 2 per rank, once: one LMDB record per shard, none twice."""
    blocks = N_PROMPTS * loadable([[0] * PROMPT_LEN]) // BLOCK
    counts = (phase_a.p1_records, phase_a.r_records, phase_a.deleted)
    assert counts == (blocks * SHARDS, blocks * SHARDS, 1), (counts, _facts(phase_a.e1))
    assert phase_a.e1["batches"][2]["outputs"] == phase_a.baselines[2]["r"]


def test_tp2_scheduler_misses_a_block_missing_one_shard(
    pair: tuple[dict[str, Any], dict[str, Any]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    """One head shard of one of R's blocks was deleted: E4's scheduler (TP=2, answering for
    both ranks) must count that block, and so the rest of its prompt, as a miss, never
    promise it (a half-loaded block would be a load error, or wrong tokens)."""
    _, e4 = pair
    got = e4["batches"][1]
    assert got["outputs"] == baselines[2]["r"], _facts(e4)
    cached = sorted(got["num_cached_tokens"])
    whole = loadable([[0] * PROMPT_LEN])
    # The three prompts without the damaged block hit whole; the fourth stops before it.
    assert cached[1:] == [whole] * (N_PROMPTS - 1), _facts(e4)
    assert cached[0] < whole and cached[0] % BLOCK == 0, _facts(e4)
    assert _counter(e4, "load_error_blocks") == 0, _facts(e4)


def _stored_events(result: dict[str, Any], medium: str = "") -> int:
    """Blocks announced to vLLM as stored (in `medium`, or in any tier)."""
    return sum(
        n
        for kind, n in result["events"].items()
        if kind.startswith("BlockStored:") and (not medium or kind == f"BlockStored:{medium}")
    )


def test_rank_layout_tp2_matches_restarts_and_survives_one_corrupted_rank(
    phase_a: PhaseA,
    phase_b: PhaseB,
    phase_c: PhaseC,
    rank_root: Path,
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    """tp_layout "rank" (one store per rank): RA, RB, RC (see the module's docstring)."""
    a, b, c = phase_a.rank_a, phase_b.rank_b, phase_c.rank_c
    assert a is not None and b is not None and c is not None
    want = baselines[2][RANK_SET]
    full = loadable([[0] * PROMPT_LEN])  # 6 whole blocks of each 200-token prompt
    first, second = a["batches"]
    assert first["outputs"] == want
    # Cold: nothing external (the prompts share no prefix: nothing from vLLM's cache either).
    assert first["num_cached_tokens"] == [0] * N_PROMPTS
    # After the reset: every rank loaded its shard of every block (a hit needs both ranks).
    assert second["outputs"] == want
    assert second["num_cached_tokens"] == [full] * N_PROMPTS
    # vLLM is told a block is stored in a tier once both ranks hold it there (each rank
    # demotes on its own schedule, so not every block is announced in the CPU tier).
    assert _stored_events(a) > 0, a["events"]
    # Each rank has its own store: its own subdirectory of every persistent tier path. The
    # shared LMDB store also has the catalog of block descriptions the scheduler (rank 0's
    # namespace) writes for routers (docs/events.md); NVMe, read by this engine alone, none.
    for tier, extra in (("nvme", []), ("lmdb", ["tp0of2.catalog"])):
        names = sorted(p.name for p in (rank_root / tier).iterdir())
        assert names == sorted(["tp0of2", "tp1of2", *extra]), names
        for rank in range(2):
            assert any(p.is_file() for p in (rank_root / tier / f"tp{rank}of2").rglob("*"))
    # Each rank wrote its own telemetry (before, rank 1 could not open its cache: the
    # Prometheus port was taken).
    stats = [read_stats(rank_root / "telemetry" / f"tp{r}of2") for r in range(2)]
    assert len({s["namespace"] for s in stats}) == 2
    assert all(s["tiers"]["cpu"]["stored"] > 0 for s in stats), stats
    # RB: a fresh process hits both ranks' persistent tiers (announced in the handshakes).
    assert b["batches"][0]["outputs"] == want
    assert b["batches"][0]["num_cached_tokens"] == [full] * N_PROMPTS
    assert _stored_events(b, "STORAGE") > 0, b["events"]
    # RC: rank 1 cannot load its corrupted shards; vLLM recomputes them: same tokens.
    assert c["batches"][0]["outputs"] == want
    assert sum(c["batches"][0]["num_cached_tokens"]) < full * N_PROMPTS


def _discovered(result: dict[str, Any], medium: str = "nvme-siblings") -> list[int]:
    """Per store snapshot (per rank with TP > 1), the blocks its siblings tier found."""
    return [int(s["stats"].get(medium, {}).get("discovered", 0)) for s in _snapshots(result)]


def test_nvme_alone_tp1_stores_tp2_loads(
    phase_b: PhaseB,
    phase_a: PhaseA,
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
    nvme_root: Path,
) -> None:
    """CPU + NVMe only: N1 (TP=1) stored P1 in instance 0; N2, a fresh TP=2 engine, hits it.
    Rank 0 reads its shards in its own instance (0), rank 1 its shards there read-only (a
    sibling), and the scheduler counts a block only with every shard found."""
    n1, n2 = phase_a.nvme_1, phase_b.nvme_2
    assert n1 is not None and n2 is not None
    assert n1["batches"][0]["outputs"] == baselines[1]["p1"], _facts(n1)
    assert_loads(n2, 0, sets["p1"], baselines[2]["p1"])
    assert n2["batches"][1]["outputs"] == baselines[2]["p2"], _facts(n2)
    assert _discovered(n2)[-1] > 0, _facts(n2)  # rank 1: from instance 0, read-only
    assert (nvme_root / "nvme" / "instance1" / "meta.json").is_file()  # rank 1's own


def test_nvme_alone_tp2_stores_tp1_loads(
    phase_c: PhaseC,
    sets: dict[str, list[list[int]]],
    baselines: dict[int, dict[str, list[list[int]]]],
) -> None:
    """N2 (TP=2) stored P2: shards 0..1 in instance 0, 2..3 in instance 1. N3, a fresh TP=1
    engine (multiprocess), owns instance 0 and reads instance 1 read-only."""
    n3 = phase_c.nvme_3
    assert n3 is not None
    assert_loads(n3, 0, sets["p2"], baselines[1]["p2"])
    assert sum(_discovered(n3)) > 0, _facts(n3)
