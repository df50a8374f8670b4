"""Frozen records exchanged between the manager, tiers, facade and connectors.

- `LoadSpec`: the answer of `prepare_load`: one location per key, groupable per tier.
- `StoreSpec`: tier and slots that `prepare_store` reserved for new blocks.
- `BlockMove`: a copy between two tiers (a demotion) that must run before the store it precedes.
- `TierWrite`: keys written from the source straight into a lower tier (write-around).
- `PrepareStoreOutput`: the answer of `prepare_store`.
- `OffloadingEvent`: blocks became ready in a tier (`removed=False`) or left it (`removed=True`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class TierSlots:
    """A batch of slots in one tier, with the positions (into the caller's key list) they serve."""

    tier: int
    medium: str
    slots: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Where each key of a `prepare_load` call lives: `tiers[i]` and `slots[i]` for `keys[i]`.

    `mediums` names every tier of the manager by index. `groups()` batches the load per tier.
    """

    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]
    slots: tuple[int, ...]
    mediums: tuple[str, ...]

    def groups(self) -> list[TierSlots]:
        """One `TierSlots` per tier that serves part of the load, fastest tier first."""
        by_tier: dict[int, tuple[list[int], list[int]]] = {}
        for pos, (t, s) in enumerate(zip(self.tiers, self.slots, strict=True)):
            entry = by_tier.get(t)
            if entry is None:
                entry = by_tier[t] = ([], [])
            entry[0].append(s)
            entry[1].append(pos)
        return [
            TierSlots(t, self.mediums[t], tuple(slots), tuple(pos))
            for t, (slots, pos) in sorted(by_tier.items())
        ]


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Slots reserved in one tier for `keys_to_store`, in the same order."""

    tier: int
    medium: str
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockMove:
    """Copy `keys` from `src` slots of one tier to `dst` slots of another.

    Demotions are listed in the order they must run: a move that frees a slot which a later
    move (or the store itself) writes into comes first.
    """

    keys: tuple[bytes, ...]
    src: StoreSpec
    dst: StoreSpec


@dataclass(frozen=True, slots=True)
class TierWrite:
    """Write `keys` from the source (engine buffer, caller's tensor) into `spec`'s slots, in
    the same order: the part of a store the first tier could not take (write-around)."""

    keys: tuple[bytes, ...]
    spec: StoreSpec


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """The plan for a store: write `keys_to_store` into `store_spec` after running `moves`.

    `evicted_keys` left the store's tier (some of them are demoted by `moves`, the rest dropped).
    `around` holds what the first tier could not take (a chain longer than it, or its room
    held by stores in flight): those keys go from the source straight into lower tiers, after
    the moves like the main store. The caller runs the moves, writes the blocks, then calls
    `complete_store` with `stored_keys` and with each move's keys.
    """

    keys_to_store: tuple[bytes, ...]
    store_spec: StoreSpec
    evicted_keys: tuple[bytes, ...]
    moves: tuple[BlockMove, ...] = ()
    around: tuple[TierWrite, ...] = ()

    @property
    def stored_keys(self) -> tuple[bytes, ...]:
        """Every key this plan writes from the source: `keys_to_store`, then `around`'s."""
        if not self.around:
            return self.keys_to_store
        return self.keys_to_store + tuple(k for w in self.around for k in w.keys)

    def writes(self) -> list[TierWrite]:
        """The plan's writes from the source, first tier first (empty ones left out)."""
        head = [TierWrite(self.keys_to_store, self.store_spec)] if self.keys_to_store else []
        return head + list(self.around)


def slot_setters(cls: type) -> tuple[Callable[[Any, Any], None], ...]:
    """The setters of `cls`'s fields (its slots), in order, for a frozen slotted record's own
    `__init__` on a hot path: the generated frozen `__init__` calls `object.__setattr__` per
    field, and a slot's own setter costs a fraction of that. The record stays frozen for
    everyone else."""
    return tuple(getattr(cls, f.name).__set__ for f in fields(cls))


@dataclass(frozen=True, slots=True, init=False)
class OffloadingEvent:
    """Blocks stored in (`removed=False`) or removed from (`removed=True`) one medium."""

    keys: tuple[bytes, ...]
    medium: str
    removed: bool

    def __init__(self, keys: tuple[bytes, ...], medium: str, removed: bool) -> None:
        # `slot_setters`: a third cheaper, and a first lookup emits one event per block.
        _set_keys(self, keys)
        _set_medium(self, medium)
        _set_removed(self, removed)


_set_keys, _set_medium, _set_removed = slot_setters(OffloadingEvent)
