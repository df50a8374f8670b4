"""The policy registry: built-in names, registered names, dotted paths, and its errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import tiercache.policies as policies
from tiercache.policies import (
    ARCPolicy,
    LRUPolicy,
    available_policies,
    get_policy_class,
    register_policy,
)


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into a private copy, so no name leaks into other tests."""
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable user module with one valid policy and a few invalid ones."""
    (tmp_path / "my_policies.py").write_text(
        textwrap.dedent(
            """
            from tiercache.policies import EvictionPolicy, LRUPolicy

            class MRUish(LRUPolicy):
                pass

            class Holder:
                Inner = MRUish

            class NotAPolicy:
                pass

            class StillAbstract(EvictionPolicy):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_policies"


def test_builtin_names() -> None:
    assert available_policies() == ["arc", "lru"]
    assert get_policy_class("lru") is LRUPolicy
    assert get_policy_class("arc") is ARCPolicy


def test_names_are_case_and_space_insensitive() -> None:
    assert get_policy_class(" ARC ") is ARCPolicy


@pytest.mark.parametrize(
    "path", ["tiercache.policies.lru.LRUPolicy", "tiercache.policies.lru:LRUPolicy"]
)
def test_dotted_path_to_builtin(path: str) -> None:
    assert get_policy_class(path) is LRUPolicy


def test_dotted_path_to_user_class(user_module: str) -> None:
    cls = get_policy_class(f"{user_module}.MRUish")
    assert cls.__name__ == "MRUish"
    assert get_policy_class(f"{user_module}:MRUish") is cls
    assert get_policy_class(f"{user_module}:Holder.Inner") is cls  # nested attribute after ':'
    assert len(cls(4)) == 0


def test_register_class_and_lazy_path(user_module: str) -> None:
    register_policy("mine", LRUPolicy)
    register_policy("later", f"{user_module}:MRUish")  # not imported until looked up
    register_policy("typo", "no_such_module_xyz:Policy")  # a bad path only fails on lookup
    assert available_policies() == ["arc", "later", "lru", "mine", "typo"]
    assert get_policy_class("MINE") is LRUPolicy
    assert get_policy_class("later").__name__ == "MRUish"
    with pytest.raises(ValueError, match="cannot load policy 'typo'"):
        get_policy_class("typo")


def test_register_same_target_twice_is_noop_but_rebinding_fails() -> None:
    register_policy("lru", LRUPolicy)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lru", ARCPolicy)


@pytest.mark.parametrize("name", ["", "  ", "a.b", "a:b"])
def test_register_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="policy name"):
        register_policy(name, LRUPolicy)


def test_register_checks_a_class_at_once() -> None:
    with pytest.raises(ValueError, match=r"'odd' is .* not an EvictionPolicy subclass"):
        register_policy("odd", dict)  # type: ignore[arg-type]
    assert "odd" not in available_policies()


def test_register_checks_a_path_on_lookup() -> None:
    register_policy("odd", "builtins.dict")
    with pytest.raises(ValueError, match=r"'odd' is .* not an EvictionPolicy subclass"):
        get_policy_class("odd")


def test_register_rejects_malformed_paths_at_once() -> None:
    with pytest.raises(ValueError, match="not a dotted path"):
        register_policy("odd", "nodots")


def test_unknown_name_lists_the_choices() -> None:
    expected = (
        "unknown policy 'foo': expected one of 'arc', 'lru' "
        "or a dotted path to an EvictionPolicy subclass"
    )
    with pytest.raises(ValueError) as excinfo:
        get_policy_class("foo")
    assert str(excinfo.value) == expected


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz.Policy", "cannot load policy 'no_such_module_xyz.Policy'"),
        ("tiercache.policies.lru:Nope", "cannot load policy 'tiercache.policies.lru:Nope'"),
        ("my_policies:NotAPolicy", "'my_policies:NotAPolicy' is .* not an EvictionPolicy"),
        ("my_policies.StillAbstract", "'my_policies.StillAbstract' is .* abstract"),
        ("tiercache.policies.base:EvictionPolicy", "abstract"),
        ("collections.OrderedDict", "not an EvictionPolicy subclass"),
        ("my_policies.", "not a dotted path"),
        (".my_policies", "not a dotted path"),
        (":LRUPolicy", "not a dotted path"),
        ("a:b:c", "not a dotted path"),
    ],
)
def test_bad_dotted_paths(user_module: str, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_policy_class(path)


def test_non_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="policy must be"):
        get_policy_class(LRUPolicy)  # type: ignore[arg-type]
