"""Conformance every persistent tier runs on top of `TierConformance`: restart recovery,
key verification on read, incompatible reopen, private file modes.

Subclasses implement `make_tier(capacity_blocks, block_bytes, tmp_path)` (same path ->
same store) and `corrupt(tier_path, key)` (damage the stored bytes of one block on disk).
"""

from __future__ import annotations

import stat

import pytest
import torch

from tests.tier_conformance import TierConformance, keys_for, rand_blocks


class PersistentTierConformance(TierConformance):
    def corrupt(self, tmp_path, key: bytes) -> None:
        raise NotImplementedError

    def test_flags(self, tier) -> None:
        assert tier.persistent is True

    def test_reopen_recovers_blocks_oldest_first(self, tmp_path) -> None:
        t = self.make_tier(8, self.block_bytes, tmp_path)
        keys = keys_for(5)
        data = rand_blocks(5, self.block_bytes, 11)
        for i in range(5):  # one write per block, so recovery order is the write order
            (s,) = t.allocate([keys[i]])
            t.write([s], data[i : i + 1], [keys[i]])
        t.flush()
        t.close()
        t2 = self.make_tier(8, self.block_bytes, tmp_path)
        try:
            rec = t2.recover()
            assert [k for k, _ in rec] == keys
            assert t2.used_blocks == 5
            slots = [s for _, s in rec]
            out = torch.empty_like(data)
            assert t2.read(slots, out, keys) == []
            assert torch.equal(out, data)
            # New allocations never hand out a recovered slot.
            fresh = t2.allocate(keys_for(3, 100))
            assert fresh is not None and not set(fresh) & set(slots)
        finally:
            t2.close()

    def test_freed_blocks_do_not_come_back(self, tmp_path) -> None:
        t = self.make_tier(8, self.block_bytes, tmp_path)
        keys = keys_for(4)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(4, self.block_bytes, 12), keys)
        t.free(slots[:2])
        t.flush()
        t.close()
        t2 = self.make_tier(8, self.block_bytes, tmp_path)
        try:
            assert sorted(k for k, _ in t2.recover()) == sorted(keys[2:])
        finally:
            t2.close()

    def test_released_blocks_stay_until_settled(self, tmp_path) -> None:
        """A demotion releases its source slot (reusable at once) but the block stays stored,
        and comes back after a restart, until `settle` (its move ended)."""
        t = self.make_tier(8, self.block_bytes, tmp_path)
        keys = keys_for(4)
        slots = t.allocate(keys)
        data = rand_blocks(4, self.block_bytes, 13)
        t.write(slots, data, keys)
        t.release(slots[:3])
        assert t.free_blocks == 8 - 1
        t.settle(slots[:1], keys[:1])
        t.close()  # as a kill would leave it: slots[1:3] released, not settled
        t2 = self.make_tier(8, self.block_bytes, tmp_path)
        try:
            rec = dict(t2.recover())
            assert sorted(rec) == sorted(keys[1:])
            out = torch.empty((3, self.block_bytes), dtype=torch.uint8)
            assert t2.read([rec[k] for k in keys[1:]], out, keys[1:]) == []
            assert torch.equal(out, data[1:])
        finally:
            t2.close()

    def test_a_released_slot_written_again_holds_the_new_block(self, tmp_path) -> None:
        t = self.make_tier(2, self.block_bytes, tmp_path)
        old, new = keys_for(2)
        (s,) = t.allocate([old])
        t.write([s], rand_blocks(1, self.block_bytes, 14), [old])
        t.release([s])
        (s2,) = t.allocate([new])
        data = rand_blocks(1, self.block_bytes, 15)
        t.write([s2], data, [new])
        t.settle([s], [old])  # the move ended after the store: the new block stays
        t.close()
        t2 = self.make_tier(2, self.block_bytes, tmp_path)
        try:
            rec = dict(t2.recover())
            assert sorted(rec) == [new]
            out = torch.empty((1, self.block_bytes), dtype=torch.uint8)
            assert t2.read([rec[new]], out, [new]) == []
            assert torch.equal(out, data)
        finally:
            t2.close()

    def test_read_of_unexpected_key_fails_that_position(self, tier) -> None:
        keys = keys_for(3)
        slots = tier.allocate(keys)
        data = rand_blocks(3, self.block_bytes, 13)
        tier.write(slots, data, keys)
        out = torch.empty_like(data)
        assert tier.read(slots, out, [keys[0], keys_for(1, 999)[0], keys[2]]) == [1]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[2])

    def test_corrupt_block_is_a_failed_position(self, tmp_path) -> None:
        t = self.make_tier(8, self.block_bytes, tmp_path)
        keys = keys_for(3)
        slots = t.allocate(keys)
        data = rand_blocks(3, self.block_bytes, 14)
        t.write(slots, data, keys)
        t.flush()
        t.close()
        self.corrupt(tmp_path, keys[1])
        t2 = self.make_tier(8, self.block_bytes, tmp_path)
        try:
            rec = dict(t2.recover())
            present = [k for k in keys if k in rec]
            out = torch.empty((len(present), self.block_bytes), dtype=torch.uint8)
            bad = t2.read([rec[k] for k in present], out, present)
            good = [k for i, k in enumerate(present) if i not in bad]
            assert keys[1] not in good  # never served, whether dropped at open or at read
            for i, k in enumerate(present):
                if k in good:
                    assert torch.equal(out[i], data[keys.index(k)])
            assert keys[0] in good and keys[2] in good
        finally:
            t2.close()

    def test_reopen_with_other_block_bytes_is_refused(self, tmp_path) -> None:
        t = self.make_tier(4, self.block_bytes, tmp_path)
        t.close()
        with pytest.raises(ValueError, match="block_bytes"):
            self.make_tier(4, self.block_bytes * 2, tmp_path)

    def test_requires_keys(self, tier) -> None:
        slots = tier.allocate(keys_for(1))
        with pytest.raises(ValueError, match="keys"):
            tier.write(slots, rand_blocks(1, self.block_bytes))

    def test_files_are_private(self, tier, tmp_path) -> None:
        for p in [tmp_path, *tmp_path.rglob("*")]:
            if p.is_symlink() or p == tmp_path:
                continue
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode & 0o077 == 0, f"{p} is {oct(mode)}"
