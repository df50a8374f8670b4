"""The shared conformance suite every `Tier` runs (subclass `TierConformance`, define
`make_tier`), plus a hypothesis state machine against a dict model of slot -> bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiercache.tiers import Tier


def keys_for(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(start, start + n)]


def rand_blocks(n: int, block_bytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=g)


class TierConformance:
    """Behaviour every tier must have. Subclasses implement `make_tier`."""

    block_bytes = 64

    def make_tier(self, capacity_blocks: int, block_bytes: int, tmp_path) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path):
        t = self.make_tier(8, self.block_bytes, tmp_path)
        yield t
        t.close()

    def test_capacity_accounting(self, tier: Tier) -> None:
        assert (tier.capacity_blocks, tier.used_blocks, tier.free_blocks) == (8, 0, 8)
        slots = tier.allocate(keys_for(3))
        assert slots is not None and len(set(slots)) == 3
        assert all(0 <= s < 8 for s in slots)
        assert (tier.used_blocks, tier.free_blocks) == (3, 5)
        tier.free(slots[:2])
        assert tier.used_blocks == 1

    def test_allocate_too_many_changes_nothing(self, tier: Tier) -> None:
        tier.allocate(keys_for(6))
        assert tier.allocate(keys_for(3, 100)) is None
        assert tier.used_blocks == 6
        assert tier.allocate(keys_for(2, 100)) is not None
        assert tier.free_blocks == 0

    def test_allocate_empty(self, tier: Tier) -> None:
        assert tier.allocate([]) == []
        assert tier.used_blocks == 0

    def test_round_trip_contiguous_and_scattered(self, tier: Tier) -> None:
        keys = keys_for(8)
        slots = tier.allocate(keys)
        data = rand_blocks(8, self.block_bytes, 1)
        tier.write(slots, data, keys)
        out = torch.empty_like(data)
        assert tier.read(slots, out, keys) == []
        assert torch.equal(out, data)
        picked = [slots[6], slots[1], slots[4]]
        out3 = torch.zeros((3, self.block_bytes), dtype=torch.uint8)
        assert tier.read(picked, out3, [keys[6], keys[1], keys[4]]) == []
        assert torch.equal(out3, data[[6, 1, 4]])

    def test_scattered_write(self, tier: Tier) -> None:
        keys = keys_for(8)
        slots = tier.allocate(keys)
        base = rand_blocks(8, self.block_bytes, 2)
        tier.write(slots, base, keys)
        patch = rand_blocks(2, self.block_bytes, 3)
        tier.write([slots[5], slots[2]], patch, [keys[5], keys[2]])
        out = torch.empty_like(base)
        assert tier.read(slots, out, keys) == []
        expected = base.clone()
        expected[5], expected[2] = patch[0], patch[1]
        assert torch.equal(out, expected)

    def test_read_into_row_view(self, tier: Tier) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        data = rand_blocks(2, self.block_bytes, 4)
        tier.write(slots, data, keys)
        big = torch.zeros((5, self.block_bytes), dtype=torch.uint8)
        assert tier.read(slots, big[2:4], keys) == []
        assert torch.equal(big[2:4], data)
        assert not big[0].any() and not big[4].any()

    @pytest.mark.parametrize(
        "bad",
        [
            torch.zeros((2, 64), dtype=torch.float32),
            torch.zeros((2, 64), dtype=torch.int8),
        ],
    )
    def test_wrong_dtype(self, tier: Tier, bad: torch.Tensor) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        with pytest.raises(TypeError, match="uint8"):
            tier.write(slots, bad[:, : self.block_bytes], keys)

    def test_wrong_shape(self, tier: Tier) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        with pytest.raises(ValueError, match="shape"):
            tier.write(slots, torch.zeros((3, self.block_bytes), dtype=torch.uint8), keys)
        with pytest.raises(ValueError, match="shape"):
            tier.read(slots, torch.zeros((2, self.block_bytes + 1), dtype=torch.uint8), keys)

    def test_non_contiguous_rejected(self, tier: Tier) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        t = torch.zeros((self.block_bytes, 2), dtype=torch.uint8).t()
        with pytest.raises(ValueError, match="contiguous"):
            tier.write(slots, t, keys)

    def test_not_a_tensor(self, tier: Tier) -> None:
        keys = keys_for(1)
        slots = tier.allocate(keys)
        with pytest.raises(TypeError, match="Tensor"):
            tier.write(slots, b"\0" * self.block_bytes, keys)  # type: ignore[arg-type]

    def test_odd_block_size(self, tmp_path) -> None:
        t = self.make_tier(4, 37, tmp_path)
        try:
            keys = keys_for(4)
            slots = t.allocate(keys)
            data = rand_blocks(4, 37, 5)
            order = [3, 0, 2, 1]
            t.write([slots[i] for i in order], data, [keys[i] for i in order])
            out = torch.empty_like(data)
            assert t.read([slots[i] for i in order], out, [keys[i] for i in order]) == []
            assert torch.equal(out, data)
        finally:
            t.close()

    def test_bad_constructor_arguments(self, tmp_path) -> None:
        with pytest.raises(ValueError, match="capacity_blocks"):
            self.make_tier(0, 64, tmp_path)
        with pytest.raises(ValueError, match="block_bytes"):
            self.make_tier(4, 0, tmp_path)

    def test_close_idempotent(self, tier: Tier) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        data = rand_blocks(2, self.block_bytes, seed=3)
        tier.write(slots, data, keys)
        tier.close()
        tier.close()  # a no-op, not an error (the fixture closes a third time)
        # Closed means released: the tier serves none of its blocks any more. It may refuse
        # the read (its file, environment, pool or client is gone) or fail every block.
        out = torch.zeros_like(data)
        try:
            failed = tier.read(slots, out, keys)
        except (OSError, RuntimeError, ValueError):
            return
        assert sorted(failed) == [0, 1] and not out.any(), failed

    def test_capability_flags(self, tier: Tier) -> None:
        assert isinstance(tier.persistent, bool) and isinstance(tier.shared, bool)
        assert tier.medium


def tier_state_machine(make_tier, block_bytes: int = 24, capacity: int = 6):
    """A RuleBasedStateMachine class checking a tier against a dict model of slot -> bytes."""

    class TierMachine(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.tier = make_tier(capacity, block_bytes)
            self.model: dict[int, bytes] = {}
            self.slot_key: dict[int, bytes] = {}
            self.seq = 0

        def teardown(self) -> None:
            if hasattr(self, "tier"):
                self.tier.close()

        @rule(n=st.integers(1, capacity), seed=st.integers(0, 2**16))
        def allocate_and_write(self, n: int, seed: int) -> None:
            keys = keys_for(n, self.seq)
            slots = self.tier.allocate(keys)
            self.seq += n
            if len(self.model) + n > capacity:
                assert slots is None
                return
            assert slots is not None and not set(slots) & set(self.model)
            data = rand_blocks(n, block_bytes, seed)
            self.tier.write(slots, data, keys)
            for s, k, row in zip(slots, keys, data, strict=True):
                self.model[s] = row.numpy().tobytes()
                self.slot_key[s] = k

        @precondition(lambda self: self.model)
        @rule(data=st.data())
        def overwrite(self, data) -> None:
            slots = data.draw(
                st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True)
            )
            blocks = rand_blocks(len(slots), block_bytes, data.draw(st.integers(0, 99)))
            self.tier.write(slots, blocks, [self.slot_key[s] for s in slots])
            for s, row in zip(slots, blocks, strict=True):
                self.model[s] = row.numpy().tobytes()

        @precondition(lambda self: self.model)
        @rule(data=st.data())
        def free_some(self, data) -> None:
            slots = data.draw(
                st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True)
            )
            self.tier.free(slots)
            for s in slots:
                del self.model[s]

        @precondition(lambda self: self.model)
        @rule(data=st.data())
        def read_back(self, data) -> None:
            slots = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1))
            out = torch.empty((len(slots), block_bytes), dtype=torch.uint8)
            assert self.tier.read(slots, out, [self.slot_key[s] for s in slots]) == []
            for s, row in zip(slots, out, strict=True):
                assert row.numpy().tobytes() == self.model[s]

        @invariant()
        def accounting(self) -> None:
            if hasattr(self, "tier"):
                assert self.tier.used_blocks == len(self.model)

    TierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
    return TierMachine
