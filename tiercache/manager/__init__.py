"""The manager package: `OffloadingManager` (`core`) and the collaborators it alone uses:
`levels`, `admission`, `adoption`, `placement`, `copies`, `through_queue`, `leaving` and
`breaker`, each module's docstring saying what it holds.
"""

from tiercache.manager.core import OffloadingManager
from tiercache.manager.levels import TierCounters

__all__ = ["OffloadingManager", "TierCounters"]
