"""Eviction policies: which resident blocks a tier drops when it needs room.

Primitives:
    EvictionPolicy              the abstract contract (policies/base.py)
    LRUPolicy, ARCPolicy        the built-in policies (policies/lru.py, policies/arc.py)
    get_policy_class(name)      "lru", "arc", any registered name, or a dotted path to a class
    register_policy(name, cls)  add a name, bound to a class or to a dotted path imported lazily
    available_policies()        the registered names, sorted

A dotted path is "pkg.mod.Class" or "pkg.mod:Class"; it is imported only when first looked up and
must name a concrete EvictionPolicy subclass. Every failure is a ValueError naming the policy.
"""

from __future__ import annotations

import importlib
import inspect

from tiercache.policies.arc import ARCPolicy
from tiercache.policies.base import EvictionPolicy
from tiercache.policies.lru import LRUPolicy

__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "available_policies",
    "get_policy_class",
    "register_policy",
]

# name -> class, or a dotted path that get_policy_class imports on first use and then caches.
_REGISTRY: dict[str, type[EvictionPolicy] | str] = {"arc": ARCPolicy, "lru": LRUPolicy}


def available_policies() -> list[str]:
    """The registered policy names, sorted (dotted paths are accepted on top of these)."""
    return sorted(_REGISTRY)


def register_policy(name: str, cls_or_dotted_path: type[EvictionPolicy] | str) -> None:
    """Bind `name` (case-insensitive, no "." or ":") to a policy class, or to a dotted path
    imported when first looked up. Re-registering a name to another target: ValueError."""
    if not isinstance(name, str) or not name.strip() or any(ch in name for ch in ".:"):
        raise ValueError(f"policy name must be a non-empty string without '.' or ':', got {name!r}")
    key = name.strip().lower()
    if isinstance(cls_or_dotted_path, str):
        _split_path(name, cls_or_dotted_path)  # reject malformed paths now
    else:
        _check_class(name, cls_or_dotted_path)
    current = _REGISTRY.get(key)
    if current is not None and current != cls_or_dotted_path:
        raise ValueError(f"policy name {key!r} is already registered to {current!r}")
    _REGISTRY[key] = cls_or_dotted_path


def get_policy_class(name: str) -> type[EvictionPolicy]:
    """Resolve a registered name or a dotted path to an EvictionPolicy subclass."""
    if not isinstance(name, str):
        raise ValueError(f"policy must be a name or dotted path string, got {name!r}")
    key = name.strip().lower()
    if key in _REGISTRY:
        target = _REGISTRY[key]
        if isinstance(target, str):
            target = _REGISTRY[key] = _import_class(name, target)
        return target
    if "." in name or ":" in name:
        return _import_class(name, name.strip())
    expected = ", ".join(repr(n) for n in available_policies())
    raise ValueError(
        f"unknown policy {name!r}: expected one of {expected} "
        "or a dotted path to an EvictionPolicy subclass"
    )


def _split_path(policy: str, path: str) -> tuple[str, str]:
    """Split "pkg.mod:Class" or "pkg.mod.Class" into (module, attribute path)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or module.startswith(".") or not attr or ":" in attr:
        raise ValueError(
            f"policy {policy!r}: {path!r} is not a dotted path like 'pkg.mod.Class' or "
            "'pkg.mod:Class'"
        )
    return module, attr


def _import_class(policy: str, path: str) -> type[EvictionPolicy]:
    """Import the class a dotted path names and check that it is a usable policy."""
    module_name, attr = _split_path(policy, path)
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {policy!r}: {exc}") from exc
    return _check_class(policy, obj)


def _check_class(policy: str, obj: object) -> type[EvictionPolicy]:
    """Return `obj` if it is a concrete EvictionPolicy subclass, else raise ValueError."""
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ValueError(f"policy {policy!r} is {obj!r}, not an EvictionPolicy subclass")
    if inspect.isabstract(obj):
        raise ValueError(f"policy {policy!r} is {obj!r}, which is abstract")
    return obj
