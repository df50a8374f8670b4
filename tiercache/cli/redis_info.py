"""`tiercache inspect` on a Redis tier of a config: what the server can tell cheaply, read-only.

Always (a few O(1) or O(clients) commands on one node): the server's version, memory in use,
`maxmemory` and its policy, the keys in the database (DBSIZE), the tiercache connections
(CLIENT LIST, by the client name every `RedisTier` sets) and the store metadata of the
config's namespace. With `scan` (the `--redis-scan` flag): SCAN over the config's `prefix`,
keys counted per namespace; O(keys in the database), so never by default. Nothing is
written; a Redis Cluster answers the scan across its primaries and the server facts of the
node the client picks.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.redis.client import (
    CLIENT_NAME,
    DEFAULT_URL,
    META_SUFFIX,
    close_client,
    glob_escape,
    make_client,
    parse_nodes,
    secret,
    shown,
)

_INSPECT_NAME = "tiercache-inspect"
_SCAN_COUNT = 1000


def _client(o: Mapping[str, Any]) -> Any:
    cluster, target = parse_nodes(o.get("url", DEFAULT_URL))
    timeout = float(o.get("timeout", 0.5))
    return make_client(
        target,
        cluster,
        timeout=max(timeout, 2.0),  # a CLI may wait longer than an engine
        username=secret(o.get("username"), o.get("username_env"), "username"),
        password=secret(o.get("password"), o.get("password_env"), "password"),
        client_name=_INSPECT_NAME,
    )


def _namespaces(client: Any, prefix: bytes) -> tuple[dict[str, int], list[str], int]:
    """Blocks per namespace under `prefix`, the namespaces with store metadata, keys seen."""
    blocks: Counter[str] = Counter()
    metas, seen = [], 0
    for key in client.scan_iter(match=glob_escape(prefix) + b"*", count=_SCAN_COUNT):
        seen += 1
        rest = bytes(key)[len(prefix) :]
        if rest.endswith(META_SUFFIX):
            metas.append(rest[: -len(META_SUFFIX)].decode(errors="replace"))
        elif len(rest) >= KEY_BYTES:
            blocks[rest[:-KEY_BYTES].decode(errors="replace")] += 1
    return dict(blocks.most_common()), sorted(metas), seen


def inspect_redis(
    options: Mapping[str, Any], namespace: str | None, *, scan: bool = False
) -> dict[str, Any]:
    """What the Redis server of a tier's `options` says about the store (see module doc);
    `namespace`: the config's, whose metadata is looked up. Read-only."""
    url = options.get("url", DEFAULT_URL)
    prefix = str(options.get("prefix", "tiercache:")).encode()
    out: dict[str, Any] = {"url": shown(url), "prefix": prefix.decode()}
    client = _client(options)
    try:
        info = client.info("all")
        if "redis_version" not in info and info:  # a cluster: per node; show one
            info = next(iter(info.values()))
        out["server"] = {
            "version": info.get("redis_version"),
            "used_memory": info.get("used_memory"),
            "maxmemory": info.get("maxmemory"),
            "maxmemory_policy": info.get("maxmemory_policy"),
        }
        out["keys_in_db"] = client.dbsize()
        clients = client.client_list()
        out["attached"] = [
            {"addr": c.get("addr"), "age_s": int(c.get("age", 0)), "idle_s": int(c.get("idle", 0))}
            for c in clients
            if c.get("name") == CLIENT_NAME
        ]
        if namespace is not None:
            raw = client.get(prefix + namespace.encode() + META_SUFFIX)
            meta = None
            if raw is not None and len(raw) < 4096:
                try:
                    meta = json.loads(bytes(raw).decode())
                except (UnicodeDecodeError, ValueError):
                    meta = "unreadable"
            out["store_meta"] = meta
        if scan:
            blocks, metas, seen = _namespaces(client, prefix)
            out.update(namespaces=blocks, namespaces_with_meta=metas, scanned_keys=seen)
    finally:
        close_client(client)
    return out
