"""The manager package: `OffloadingManager` (`core`) and the collaborators it alone uses.

- `core`: `OffloadingManager`, the bookkeeping brain over an ordered list of tiers;
- `levels`: per-tier state (`Level`, `TierCounters`) and the outstanding loads (`Loads`);
- `admission`: the ghost map of sightings for tiers that admit on reuse;
- `through_queue`: the write-through copies waiting to be planned;
- `leaving`: blocks a move is taking out of a tier, still readable from their source slot;
- `breaker`: the circuit breaker over tiers that keep failing.
"""

from tiercache.manager.core import OffloadingManager
from tiercache.manager.levels import TierCounters

__all__ = ["OffloadingManager", "TierCounters"]
