"""The small set of tiercache exceptions.

- `ConfigError`: an invalid configuration (a `ValueError` whose message names the field).
- `TierUnavailableError`: a tier cannot start here (e.g. a GPU tier without CUDA).
- `BlockCorruptError`: bytes read back failed verification; callers treat it as a miss.
- `StoreError`: a store cannot be used for what was asked (offline tools).
- `check_count(name, value)`: the one check of an argument that must be an int >= 1.
- `IO_ERRORS`: what a tier raises for failed I/O (the facade's plan runner and the transfer
  handlers catch these and fail the blocks concerned; anything else is a bug and propagates).
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Base class of tiercache's own errors."""


class ConfigError(TierCacheError, ValueError):
    """An invalid configuration; the message starts with the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class TierUnavailableError(TierCacheError, RuntimeError):
    """A tier cannot be built on this machine (missing device, library or permission)."""


class BlockCorruptError(TierCacheError):
    """Stored bytes failed verification; the block must be treated as a miss."""


class StoreError(TierCacheError):
    """A store cannot be used for what was asked (e.g. it is open in another process)."""


def check_count(name: str, value: object) -> None:
    """`ValueError` naming `name` unless `value` is an int >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


# Errors a tier raises for failed I/O: they fail the blocks concerned. Anything else is a bug
# and propagates.
IO_ERRORS = (OSError, BlockCorruptError)
