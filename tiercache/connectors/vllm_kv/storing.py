"""`StoresInFlight`: the keys of store plans the worker has not reported finished (remote
placement), so that a lookup reaching one asks again next step instead of recomputing a
block about to be stored; a key is waited for at most the store deadline after its plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["StoresInFlight"]


class StoresInFlight:
    """Keys being stored, per request, each with the time its wait ends."""

    __slots__ = ("_by_req", "_clock", "_until", "wait_s")

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        self._clock = clock
        self._until: dict[bytes, float] = {}
        self._by_req: dict[str, list[bytes]] = {}

    def planned(self, req_id: str, keys: Sequence[bytes]) -> None:
        """`req_id` planned stores of `keys`."""
        until = self._clock() + self.wait_s
        self._until.update(dict.fromkeys(keys, until))
        self._by_req.setdefault(req_id, []).extend(keys)

    def storing(self, key: bytes) -> bool:
        """Whether `key` belongs to a plan not reported finished, planned less than `wait_s`
        ago."""
        until = self._until.get(key)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._until[key]
        return False

    def finished(self, req_id: str) -> None:
        """`req_id`'s plans are all reported finished (or it had none left)."""
        for k in self._by_req.pop(req_id, ()):
            self._until.pop(k, None)
