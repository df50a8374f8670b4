"""`insert_cold`: copies a tier keeps only while it has room (write-through) are evicted
before every other key, by LRU and ARC alike, and join the policy proper once used."""

from __future__ import annotations

import pytest

from tiercache.policies import ARCPolicy, LRUPolicy


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_cold_keys_go_first_in_their_order(cls) -> None:
    p = cls(8)
    p.insert_many([K(0), K(1), K(2)])
    p.touch([K(0)])
    p.insert_cold([K(10), K(11)])
    assert len(p) == 5 and K(10) in p
    assert list(p.keys_in_eviction_order())[:2] == [K(10), K(11)]
    assert p.evict(1) == [K(10)]
    # Protected cold keys are skipped; the policy's own order takes over after them.
    victims = p.evict(2, protected={K(11)})
    assert victims is not None and K(11) not in victims and len(victims) == 2
    assert K(11) in p


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_a_used_cold_key_is_kept_like_any_other(cls) -> None:
    p = cls(4)
    p.insert_cold([K(1), K(2)])
    p.insert_many([K(3)])
    p.touch([K(1)])  # a hit: it is a key like the others now
    p.remove(K(2))
    p.insert(K(2))  # made as recent as a demotion
    assert p.evict(1) == [K(3)]


def test_arc_cold_evictions_leave_no_ghost_and_do_not_move_p() -> None:
    p = ARCPolicy(4)
    p.insert_many([K(1), K(2)])
    p.insert_cold([K(7), K(8)])
    before = p.state()
    assert p.evict(2) == [K(7), K(8)]
    after = p.state()
    assert (after.b1, after.b2, after.p) == (before.b1, before.b2, before.p)
    assert after.cold == () and (after.t1, after.t2) == (before.t1, before.t2)
