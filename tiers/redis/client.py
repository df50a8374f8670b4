"""The Redis client side of the Redis tier, public: the tier and the CLI (`tiercache inspect`)
both use it, so a URL, a credential or a cluster is understood one way.

- `parse_nodes(url)`: a tier's `url` option -> (cluster?, one URL or the cluster node URLs);
  `host_port(url)`; ConfigError naming the field on anything malformed.
- `mask(url)` / `shown(target)`: URLs for messages, passwords replaced by ***.
- `secret(value, env, field)`: a credential given directly or through an environment variable.
- `make_client(target, cluster, ...)`: a redis-py client (single node or Redis Cluster) with
  bounded timeouts; `close_client(client)` when done with it.
- `auth_error(exc, shown)`: the ConfigError a refused authentication becomes (no secret).
- `glob_escape(b)`: bytes matched literally in a SCAN pattern.
- `pipeline(client, cmds, cluster)`: commands sent as one pipelined batch, one reply each;
  on a single node `send_packed` packs it so large payloads go out without a copy.
- The store's layout on the server (`STORE_FORMAT`, `STORE_VERSION`, `META_SUFFIX`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from tiercache.errors import ConfigError

STORE_FORMAT = "tiercache-redis"
STORE_VERSION = 1
META_SUFFIX = b"#meta"  # never 16 bytes long, so it can never collide with a block key
CLIENT_NAME = "tiercache"  # every tier's connections carry it (`inspect` counts them)
DEFAULT_URL = "redis://127.0.0.1:6379/0"
SEND_INLINE_MAX = 16 * 1024  # arguments this big are sent as their own buffer, not copied
NET_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


def parse_nodes(url: object, field: str = "url") -> tuple[bool, list[str] | str]:
    """(cluster?, what to connect to): one URL for a single node, or cluster node URLs.

    `redis://`, `rediss://`, `unix://` name one node; `redis+cluster://h:p[,h:p...]` (or
    `rediss+cluster://`) or a list of `host:port` / `redis://host:port` name cluster nodes.
    """
    if isinstance(url, list | tuple):
        if not url:
            raise ConfigError(field, "an empty list of cluster nodes")
        nodes = []
        for i, u in enumerate(url):
            if not isinstance(u, str) or not u:
                raise ConfigError(f"{field}[{i}]", f"expected 'host:port', got {u!r}")
            nodes.append(u if "://" in u else f"redis://{u}")
            host_port(nodes[-1], f"{field}[{i}]")
        return True, nodes
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(field, f"expected a redis:// URL or a list of cluster nodes, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        try:
            parse_url(url)
        except ValueError as exc:
            raise ConfigError(field, f"{mask(url)}: {exc}") from None
        if scheme != "unix":
            host_port(url, field)
        return False, url
    if scheme in ("redis+cluster", "rediss+cluster"):
        base = scheme.split("+", 1)[0]
        rest = url.split("://", 1)[1]
        auth, _, hosts = rest.rpartition("@")
        nodes = []
        for h in hosts.split("/", 1)[0].split(","):
            node = f"{base}://{auth + '@' if auth else ''}{h}"
            host_port(node, field)
            nodes.append(node)
        return True, nodes
    raise ConfigError(
        field,
        f"unknown scheme {scheme!r}; use redis://, rediss://, unix://, redis+cluster:// "
        "or a list of cluster nodes",
    )


def host_port(url: str, field: str) -> tuple[str, int]:
    """(host, port) of a node URL (port 6379 when none); ConfigError naming `field`."""
    try:
        u = urlsplit(url)
        host, port = u.hostname, u.port or 6379
    except ValueError as exc:
        raise ConfigError(field, f"{mask(url)}: {exc}") from None
    if not host:
        raise ConfigError(field, f"{mask(url)}: no host")
    return host, port


def mask(url: str) -> str:
    """The URL with any password replaced by ***, for messages."""
    try:
        u = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if u.password is None:
        return url
    user = u.username or ""
    host = u.netloc.rpartition("@")[2]
    return urlunsplit((u.scheme, f"{user}:***@{host}", u.path, u.query, u.fragment))


def shown(target: str | Sequence[str]) -> str:
    """One URL, or a list of cluster nodes comma-joined, masked (`mask`)."""
    return mask(target) if isinstance(target, str) else ",".join(map(mask, target))


def glob_escape(b: bytes) -> bytes:
    """`b` with the SCAN glob's special characters escaped: it matches only itself."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", b)


def secret(value: str | None, env: str | None, field: str) -> str | None:
    """A credential given directly or through the environment variable `env`."""
    if env is None:
        return value
    got = os.environ.get(env)
    if got is None:
        raise ConfigError(f"{field}_env", f"environment variable {env!r} is not set")
    return got


def make_client(
    target: str | Sequence[str],
    cluster: bool,
    *,
    timeout: float,
    username: str | None = None,
    password: str | None = None,
    client_name: str = CLIENT_NAME,
) -> Any:
    """A client of `parse_nodes`'s answer: socket operations bounded by `timeout`, a dropped
    connection retried once at once, connections named `client_name`. A cluster client
    contacts its nodes here; credentials given in a cluster URL apply to every node."""
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": retry,
        "client_name": client_name,
    }
    if username is not None:
        common["username"] = username
    if password is not None:
        common["password"] = password
    if not cluster:
        assert isinstance(target, str)
        opts = parse_url(target)
        opts.update(common)
        return redis.Redis(connection_pool=ConnectionPool(**opts))
    first = urlsplit(target[0])
    auth: dict[str, Any] = {}
    if first.username and "username" not in common:
        auth["username"] = first.username
    if first.password and "password" not in common:
        auth["password"] = first.password
    nodes = [ClusterNode(*host_port(u, "url")) for u in target]
    return RedisCluster(
        startup_nodes=nodes,
        ssl=first.scheme == "rediss",
        **common,
        **auth,
    )


def close_client(client: Any) -> None:
    """Close `client` and disconnect its pool's connections (a caller done with the server,
    such as `tiercache inspect`; a cluster client closes its nodes' connections itself)."""
    client.close()
    if isinstance(client, redis.Redis):
        client.connection_pool.disconnect()


def auth_error(exc: Exception, shown_url: str) -> ConfigError:
    """What a refused authentication at `shown_url` (masked) means, as a ConfigError."""
    text = str(exc)
    needs = ("NOAUTH", "Authentication required", "already authenticated")
    if any(n in text for n in needs):  # the last: HELLO sent without credentials
        return ConfigError(
            "password",
            f"the Redis server at {shown_url} requires authentication; "
            "set password (or password_env naming an environment variable)",
        )
    if "WRONGPASS" in text or "invalid username-password" in text or "auth" in text.lower():
        return ConfigError(
            "password",
            f"the Redis server at {shown_url} refused the credentials (wrong username or password)",
        )
    return ConfigError("url", f"the Redis server at {shown_url} refused us: {text}")


def pipeline(client: Any, cmds: list[list[Any]], cluster: bool) -> list[Any]:
    """Send `cmds` in one pipelined batch; one reply each, per-command errors returned in
    the list. An argument may be a (header, payload) pair: one Redis string. Network and
    client errors are raised as redis-py raises them."""
    if cluster:
        pipe = client.pipeline(transaction=False)
        for cmd in cmds:
            pipe.execute_command(*(b"".join(a) if isinstance(a, tuple) else a for a in cmd))
        return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]
    return send_packed(client, cmds)


def send_packed(client: redis.Redis, cmds: list[list[Any]]) -> list[Any]:
    """A pipeline on one pooled connection, packed here so that a (header, payload) value
    goes out as two buffers, the payload from the caller's tensor. A connection that fails
    before any reply was read is retried once on a fresh one (every command is idempotent)."""
    buffers: list[bytes | memoryview] = []
    small = bytearray()
    for cmd in cmds:
        small += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            if isinstance(arg, str):
                arg = arg.encode()
            parts = arg if isinstance(arg, tuple) else (arg,)
            small += b"$%d\r\n" % sum(len(p) for p in parts)
            for p in parts:
                if len(p) >= SEND_INLINE_MAX:
                    buffers.append(bytes(small))
                    small.clear()
                    buffers.append(p)
                else:
                    small += p
            small += b"\r\n"
    buffers.append(bytes(small))
    pool = client.connection_pool
    for attempt in (0, 1):
        conn = pool.get_connection()
        out: list[Any] = []
        try:
            conn.send_packed_command(buffers, check_health=False)
            for _ in cmds:
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:
                    out.append(exc)
            return out
        except RedisConnectionError:
            conn.disconnect()
            if attempt or out:
                raise
        except BaseException:
            conn.disconnect()  # a half-read reply stream must never be reused
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")
