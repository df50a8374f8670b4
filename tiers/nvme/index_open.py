"""Reading an NVMe store's index at open: its image, else every slot header the journal names.

- `read_image(path, journal, slab_slots)`: the index image, if it is whole and covers this
  journal, with the records after it replayed over it: no slot is read. None (each reason
  logged) sends the caller to `read_headers`.
- `read_headers(journal, fd, ...)`: the journal replayed, each entry kept only where its
  slot's header agrees, the headers read on the tier's I/O pool.
Both hand back a `recovery.Replayed` for the tier to settle; they change no file.
"""

from __future__ import annotations

import logging
import os

from tiercache.tiers.nvme import recovery
from tiercache.tiers.nvme.image import IndexImage, decode_image
from tiercache.tiers.nvme.io import ALIGN, AlignedBuffer, Slab
from tiercache.tiers.nvme.journal import Entries, replay_journal
from tiercache.tiers.nvme.layout import IMAGE, open_nofollow

log = logging.getLogger(__package__)  # "tiercache.tiers.nvme", as the tier's


def read_image(
    path: str, journal: bytes, slab_slots: int
) -> tuple[IndexImage, recovery.Replayed] | None:
    """The image of the store at `path` and the entries it gives with `journal` replayed after
    it, in a slab of `slab_slots` slots; None when it is missing, damaged, stale, or names no
    writer while the journal after it puts blocks."""
    try:
        with open(os.path.join(path, IMAGE), "rb", opener=open_nofollow) as f:
            img = decode_image(f.read())
    except FileNotFoundError:
        if journal:
            log.warning("%s: no index image; reading every slot header", path)
        return None
    except OSError as exc:
        log.warning("%s: the index image is unreadable (%s)", path, exc)
        return None
    if img is None:
        log.warning("%s: the index image is damaged; reading every slot header", path)
        return None
    if not recovery.image_matches(img, journal):
        log.warning(
            "%s: the index image does not match the journal (stale, or the journal was "
            "damaged); reading every slot header",
            path,
        )
        return None
    got = recovery.from_image(img, journal, slab_slots)
    if got is None:
        log.warning("%s: the index image names no writer; reading every header", path)
        return None
    return img, got


def read_headers(journal: bytes, path: str, slab: Slab) -> tuple[recovery.Replayed, int]:
    """`journal` replayed over `slab` of the store at `path`, each entry kept only where its
    slot's header agrees; and how many headers were read."""
    sb, fd, block_bytes, pipeline = slab.slot_bytes, slab.fd, slab.block_bytes, slab.pipeline
    entries, report = replay_journal(journal, os.fstat(fd).st_size // sb, per_key=False)
    items = [(e.slot, e.key, e.seq) for e in entries]

    def header(i: int, buf: AlignedBuffer, got: int | BaseException) -> int | None:
        if isinstance(got, BaseException):
            return None
        return recovery.header_ns(buf.view, got, items[i][1], items[i][2], block_bytes)

    ns_of = pipeline.run(
        len(items),
        lambda i, buf: os.preadv(fd, [buf.view[:ALIGN]], items[i][0] * sb),
        lambda i, buf: None,
        header,
        writes=False,
    )
    checked = [(*it, ns) for it, ns in zip(items, ns_of, strict=True) if ns is not None]
    if len(items) != len(checked):
        log.warning(
            "%s: %d indexed blocks failed their header check and were dropped",
            path,
            len(items) - len(checked),
        )
    replayed = recovery.Replayed(
        Entries.of(checked),
        report.damaged,
        report.out_of_range + len(items) - len(checked),
        report.top_seq,
        distinct=False,
    )
    return replayed, len(items)
