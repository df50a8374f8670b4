"""Read-only probes of a config's shared tiers (LMDB, Redis), for a scheduler whose worker
(and so whose cache) runs in another process: `open_probes(config, block_bytes)` and
`probe_chain(probes, keys)`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from tiercache.config import CacheConfig
from tiercache.errors import ConfigError
from tiercache.tiers import tier_class
from tiercache.tiers.base import StoreProbe

log = logging.getLogger("tiercache.connectors.common")  # the adapters' helpers' one logger


def open_probes(config: CacheConfig, block_bytes: int) -> list[tuple[str, StoreProbe]]:
    """Read-only probes of `config`'s shared tiers, fastest first (`Tier.open_probe`), with
    each tier's medium; a tier whose probe cannot be made is left out with a warning."""
    probes: list[tuple[str, StoreProbe]] = []
    for t in config.tiers:
        try:
            probe = tier_class(t.kind).open_probe(t, block_bytes, namespace=config.namespace)
        except (ConfigError, OSError) as exc:
            log.warning("tiercache: no probe of tier %s (%s): %s", t.name, t.kind, exc)
            continue
        if probe is not None:
            probes.append((t.name, probe))
    return probes


def probe_chain(
    probes: Sequence[tuple[str, StoreProbe]],
    keys: Sequence[bytes],
    off: Collection[str] = (),
) -> int:
    """How many leading `keys` the first probe that holds any of them holds, as the manager's
    discovery adopts them; mediums in `off` (suspended) are not asked."""
    for medium, p in probes:
        if medium in off:
            continue
        n = p.probe(keys)
        if n:
            return n
    return 0
