"""The connector's settings, read once from vLLM's configuration, and its tunables.

`KVSettings` is what both roles are built from (`KVSettings.from_vllm`; tests build it
directly). `RoleBase` is the counting both roles share. This is the bottom module of the
package: it imports nothing from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.config import CacheConfig
from tiercache.connectors.kv_groups import KVGroup, groups_tag, kv_groups
from tiercache.connectors.namespace import namespace_from_vllm, read_user_config
from tiercache.connectors.ranks import RankConfig, resolve_rank_config
from tiercache.connectors.stores import SharedStore, release_store
from tiercache.connectors.tp_layout import blocks_as_shards, check_no_rank_dirs, choose_shards
from tiercache.errors import ConfigError
from tiercache.transfer.head_shards import HeadShards

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Every module of the package logs under the name the single module had.
log = logging.getLogger("tiercache.connectors.vllm_kv")

BAD_KEYS_MAX = 1 << 16  # damaged keys the scheduler remembers (see RemoteIndex._probe_ranks)
PROBE_WAIT_S = 0.02  # how long a lookup waits for the shared tiers' probes (see RemoteIndex)
SETTLE_KEY = "kv.settle"  # SharedStore.state: the local worker role's `_settle`
SETTLE_WAIT_S = 0.5  # how long a local lookup waits for a store of the key it reached
MOVE_WAIT_S = 0.05  # ... and for a move: while one runs the lookup answers None (asks again)
VERIFY_WAIT_S = 0.05  # how long a local lookup waits for its verifying read (see LocalLookup)
IDLE_WAIT_S = 0.005  # a step without a forward: how long the worker waits for a load (_wait_idle)


@dataclass(frozen=True)
class KVSettings:
    """What a role needs to know, fixed for its life. `config` is this rank's store;
    `key_namespace` hashes block keys, the same on every rank (None: `config.namespace`);
    `rank_configs` are every rank's configs (the scheduler probes their shared tiers);
    `shards` (None: the per-rank layout) maps engine blocks to head shards, whose bytes
    `block_bytes` then counts."""

    config: CacheConfig
    block_size: int  # tokens per block
    block_bytes: int  # bytes per block of one KV cache group (head shards: of one shard)
    num_blocks: int = 0  # blocks in the engine's KV cache (the worker's layout)
    tp_size: int = 1
    tp_rank: int = 0  # this worker's; the scheduler's is 0
    groups: tuple[KVGroup, ...] = ()
    key_namespace: str | None = None
    loads_on: bool = True  # kv_role "kv_both" or "kv_consumer"
    stores_on: bool = True  # kv_role "kv_both" or "kv_producer"
    rank: RankConfig | None = field(default=None, compare=False)  # this rank (dirs to make)
    rank_configs: tuple[CacheConfig, ...] = ()
    shards: HeadShards | None = None
    engine_block_bytes: int = 0  # this rank's bytes of an engine block (0: block_bytes)
    kv_heads: int = 0  # this rank's KV heads (head shards: checked against the KV caches)
    recompute_failures: bool = False  # kv_load_failure_policy "recompute" (LocalLookup.direct)
    # vLLM publishes KV events (enable_kv_cache_events): only then does the scheduler build
    # vLLM's events (vLLM drops them otherwise).
    events: bool = True
    hash_algo: str = "sha256"  # vLLM's prefix_caching_hash_algo (shared_blocks' hashes)
    events_poll_s: float = 0.5  # extra config "events_poll_s": polls of shared stores' events
    # extra config "memory_loads": "sync" loads a remote hit held in memory tiers before the
    # step's forward; "async" (default) reports it done a step later, as disk hits are.
    sync_memory_loads: bool = False

    @property
    def hma(self) -> bool:
        """Several KV cache groups (a hybrid model under vLLM's hybrid KV cache manager)."""
        return len(self.groups) > 1

    @property
    def keys_namespace(self) -> str:
        return self.config.namespace if self.key_namespace is None else self.key_namespace

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, *, worker: bool
    ) -> KVSettings:
        """Parse the settings of one role (`worker`: the worker role) from vLLM's config."""
        if kv_cache_config is None:
            raise ValueError("TierCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        parallel = vllm_config.parallel_config
        world = int(parallel.world_size)
        tp_size = int(parallel.tensor_parallel_size)
        if world != tp_size:
            raise ValueError(
                f"TierCacheConnector: parallel world size {world} with tensor parallel size "
                f"{tp_size} is not supported; pipeline (and context) parallel size must be 1"
            )
        # Several groups: a hybrid model (refused where tiercache cannot serve them right).
        groups: tuple[KVGroup, ...] = kv_groups(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        block_size = int(spec.block_size)
        device = str(vllm_config.device_config.device_type)
        layout = f"{kv_cache_config.kv_cache_layout or 'default'}/{device}/{type(spec).__name__}"
        layout += groups_tag(groups)  # hybrid: blocks of one group's layers
        tp_rank = _worker_tp_rank() if worker and tp_size > 1 else 0
        ktc = vllm_config.kv_transfer_config
        events_config = getattr(vllm_config, "kv_events_config", None)
        assert ktc is not None
        user = read_user_config(ktc.kv_connector_extra_config)
        # One layout for every TP size where the engine allows it (connectors/tp_layout.py).
        shards = choose_shards(
            ktc.kv_connector_extra_config,
            spec=spec,
            groups=len(groups),
            kv_cache_layout=kv_cache_config.kv_cache_layout,
            total_kv_heads=_total_kv_heads(vllm_config),
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        per_rank = shards is None
        if shards is not None:
            layout += f"/heads:{shards.shards}"
            user = blocks_as_shards(user, shards)

        def namespace(r: int) -> str:
            return namespace_from_vllm(vllm_config, layout=layout, tp_rank=r, per_rank=per_rank)

        def rank_config(r: int) -> RankConfig:
            return resolve_rank_config(
                user,
                block_size=block_size,
                key_namespace=namespace(0),
                store_namespace=namespace(r),
                tp_rank=r,
                tp_size=tp_size,
                shared=not per_rank,
                # Data-parallel ranks (and replicas) share the shared tiers; each opens an
                # NVMe instance of its own (`per_dp_rank_config`).
                dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
                dp_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
            )

        rank = rank_config(tp_rank)
        if shards is not None:
            check_no_rank_dirs(rank.config)
        # The scheduler probes every rank's shared tiers (with head shards the ranks share them).
        ranks = range(1, tp_size) if per_rank and not worker else range(0)
        others = tuple(rank_config(r).config for r in ranks)
        engine_bytes = groups[0].block_bytes
        return cls(
            config=rank.config,
            block_size=block_size,
            block_bytes=engine_bytes // shards.local if shards is not None else engine_bytes,
            num_blocks=int(kv_cache_config.num_blocks),
            tp_size=tp_size,
            tp_rank=tp_rank,
            groups=groups,
            key_namespace=rank.key_namespace,
            loads_on=bool(ktc.is_kv_consumer),
            stores_on=bool(ktc.is_kv_producer),
            rank=rank,
            rank_configs=() if worker else (rank.config, *others),
            shards=shards,
            engine_block_bytes=engine_bytes,
            kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
            recompute_failures=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute",
            events=bool(getattr(events_config, "enable_kv_cache_events", False)),
            events_poll_s=_poll_s(ktc.kv_connector_extra_config),
            sync_memory_loads=_memory_loads(ktc.kv_connector_extra_config) == "sync",
            hash_algo=str(
                getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None) or "sha256"
            ),
        )


def _poll_s(extra: Any) -> float:
    """`kv_connector_extra_config["events_poll_s"]`, checked (ConfigError)."""
    v = (extra or {}).get("events_poll_s", 0.5)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 60:
        raise ConfigError("kv_connector_extra_config.events_poll_s", f"expected 0-60 s, got {v!r}")
    return float(v)


def _memory_loads(extra: Any) -> str:
    """`kv_connector_extra_config["memory_loads"]`: "sync" or "async", checked (ConfigError)."""
    v = (extra or {}).get("memory_loads", "async")
    if v not in ("sync", "async"):
        raise ConfigError(
            "kv_connector_extra_config.memory_loads", f"expected 'sync' or 'async', got {v!r}"
        )
    return str(v)


class RoleBase:
    """What both roles share: the store they hold (`release`), and their counters, reported to
    vLLM (`take_stats`) and added to the store's counters (telemetry) while they hold it."""

    def __init__(self, settings: KVSettings, shared: SharedStore | None) -> None:
        self.settings = settings
        self._shared = shared
        self._stats: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + n
        if self._shared is not None:
            self._shared.count(name, n)

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (empty: nothing counted)."""
        stats, self._stats = self._stats, {}
        return stats

    def release(self) -> None:
        """Drop this role's reference to the store (the last one closes it: write-back, flush)."""
        shared, self._shared = self._shared, None
        if shared is not None:
            release_store(shared)


def _total_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's KV heads over all TP ranks (None where vLLM does not say)."""
    get = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    try:
        return int(get()) if get is not None else None
    except Exception:  # an attention-free or unusual model: decided from the spec instead
        return None


def _worker_tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM has set up its TP group before it builds the
    worker's connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
