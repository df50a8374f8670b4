"""What a transfer job names: engine block ids on one side, tier slots on the other.

Primitives:
- `GPULoadStoreSpec(block_ids)`: blocks of the engine's paged KV buffer (medium `ENGINE_MEDIUM`,
  "GPU" as vLLM calls it, also when the engine runs on CPU). An offloaded block spans
  `block_size_factor` engine blocks, so a spec for n offloaded blocks names n * factor ids.
- `TierLoadStoreSpec(tier, medium, slots, keys)`: slots of one tier (index into the manager's
  tiers) and the keys they hold (persistent tiers check them).
- `TransferSpec`: a `(src, dst)` pair, what `OffloadingWorker.transfer_async` takes.
- `load_transfers`, `store_transfers`, `move_transfer`: the transfers for a manager plan
  (`LoadSpec`, `PrepareStoreOutput`, `BlockMove`), in the order they must be submitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from tiercache.records import BlockMove, LoadSpec, PrepareStoreOutput, slot_setters

ENGINE_MEDIUM = "GPU"


# The specs set their slots directly (`slot_setters`): a decode-time store builds two specs
# per block.
@dataclass(frozen=True, slots=True, init=False)
class GPULoadStoreSpec:
    """Engine block ids, in the order of the offloaded blocks they make up."""

    block_ids: tuple[int, ...]
    medium: ClassVar[str] = ENGINE_MEDIUM

    def __init__(self, block_ids: Sequence[int]) -> None:
        _set_block_ids(self, tuple(map(int, block_ids)))


@dataclass(frozen=True, slots=True, init=False)
class TierLoadStoreSpec:
    """Slots of tier `tier` (named `medium`); `keys[i]` is the block in `slots[i]`."""

    tier: int
    medium: str
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]

    def __init__(self, tier: int, medium: str, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        slots = tuple(map(int, slots))
        keys = tuple(keys)
        if len(slots) != len(keys):
            raise ValueError(f"TierLoadStoreSpec: {len(slots)} slots but {len(keys)} keys")
        _set_tier(self, tier)
        _set_medium(self, medium)
        _set_slots(self, slots)
        _set_keys(self, keys)


(_set_block_ids,) = slot_setters(GPULoadStoreSpec)
_set_tier, _set_medium, _set_slots, _set_keys = slot_setters(TierLoadStoreSpec)


LoadStoreSpec: TypeAlias = GPULoadStoreSpec | TierLoadStoreSpec
TransferSpec: TypeAlias = tuple[LoadStoreSpec, LoadStoreSpec]


def _engine_ids(block_ids: Sequence[int], positions: Sequence[int], factor: int) -> list[int]:
    return [block_ids[p * factor + j] for p in positions for j in range(factor)]


def _check_ids(block_ids: Sequence[int], n_keys: int, factor: int) -> None:
    if len(block_ids) != n_keys * factor:
        raise ValueError(
            f"block_ids: expected {n_keys * factor} engine blocks for {n_keys} keys, "
            f"got {len(block_ids)}"
        )


def load_transfers(
    spec: LoadSpec, block_ids: Sequence[int], block_size_factor: int = 1
) -> list[TransferSpec]:
    """One transfer per tier serving part of a `prepare_load`: tier slots -> engine blocks.

    `block_ids` are the engine blocks receiving `spec.keys`, `block_size_factor` per key. The
    load is complete when every transfer succeeded; positions in a result's `failed` index
    that transfer's own slots.
    """
    _check_ids(block_ids, len(spec.keys), block_size_factor)
    out: list[TransferSpec] = []
    for g in spec.groups():
        keys = tuple(spec.keys[p] for p in g.positions)
        src = TierLoadStoreSpec(g.tier, g.medium, g.slots, keys)
        out.append((src, GPULoadStoreSpec(_engine_ids(block_ids, g.positions, block_size_factor))))
    return out


def move_transfer(move: BlockMove) -> TransferSpec:
    """A tier-to-tier copy (a demotion or write-back); complete it with its keys."""
    return (
        TierLoadStoreSpec(move.src.tier, move.src.medium, move.src.slots, move.keys),
        TierLoadStoreSpec(move.dst.tier, move.dst.medium, move.dst.slots, move.keys),
    )


def store_transfers(
    plan: PrepareStoreOutput,
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    block_size_factor: int = 1,
) -> list[TransferSpec]:
    """The plan's moves (in order), then its writes: engine -> first tier for
    `plan.keys_to_store`, then engine -> lower tier for each write-around part.

    `keys` are the keys given to `prepare_store` and `block_ids` their engine blocks
    (`block_size_factor` per key); only the blocks the plan writes are copied. Submit the
    list in order: the worker orders a store after the moves that read the slots it reuses.
    """
    _check_ids(block_ids, len(keys), block_size_factor)
    out = [move_transfer(m) for m in plan.moves]
    pos = {k: i for i, k in enumerate(keys)}
    for w in plan.writes():
        try:
            positions = [pos[k] for k in w.keys]
        except KeyError:
            raise ValueError("keys: does not contain every key the plan stores") from None
        s = w.spec
        eng = GPULoadStoreSpec(_engine_ids(block_ids, positions, block_size_factor))
        out.append((eng, TierLoadStoreSpec(s.tier, s.medium, s.slots, w.keys)))
    return out
