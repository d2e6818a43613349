"""A front-end process's shared memory for the tensors of the requests it hands to the core: the device worker reads
them from here (one pread into its batch), so the core never touches them.

First-fit allocation over segments the process owns (gpud.executor.shm: plain files in /dev/shm, removed when the
arena closes); a request's blocks are freed when it is answered. When no segment has room, another is made, twice
the size needed at least: the arena grows with the bytes in flight, never per request. It gives memory back when
the bytes in flight fall again (`trim`, called every few seconds): a segment past the first, or one made larger than
the default for a large tensor, that stayed wholly free from one trim to the next has its pages released (the
segment stays, so nothing that knows its path needs telling; pages come back as it is written again).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpud.executor import shm_owners
from gpud.executor.shm import Segment, align, new_segment_name, segment_path, shm_dir
from gpud.executor.types import RegionSlice

DEFAULT_SEGMENT_BYTES = 64 << 20
TRIM_INTERVAL_S = 10.0  # how often a front-end process trims its arena: memory comes back 10-20 s after a burst
ARENA_TAG = "fe"  # its segments' names: gpud-<the process's pid>-fe-<n>-<random>


def remove_arena_of(pid: int) -> None:
    """Remove a front-end process's segments and lock (gpud.frontproc.host, once the process is gone: killed, it
    could not remove them itself)."""
    shm_owners.remove_owned_by(shm_dir(), pid)


@dataclass(eq=False)
class _Space:
    segment: Segment
    path: str
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, size), by offset, merged
    keep: bool = False  # the first segment of the default size: kept warm, never released
    used: bool = True  # taken from since the last trim
    released: bool = False  # its pages given back, and not taken from since

    @property
    def empty(self) -> bool:
        return self.free == [(0, self.segment.size_bytes)]

    def take(self, size: int) -> int | None:
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                self.used = True
                self.released = False
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        i = bisect.bisect(self.free, (offset, size))
        self.free.insert(i, (offset, size))
        # merge with the neighbours
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
            size += self.free[i + 1][1]
            self.free[i] = (offset, size)
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + size)
            del self.free[i]


class Block:
    """Where a request's rows lie in the arena, to give back. Read only. A plain class (one per request; compiled,
    a dataclass's generated __init__ would stay interpreted)."""
    __slots__ = ("space", "offset", "size")

    def __init__(self, space: _Space, offset: int, size: int) -> None:
        self.space = space
        self.offset = offset
        self.size = size


class Arena:
    def __init__(self, segment_bytes: int = DEFAULT_SEGMENT_BYTES):
        self.segment_bytes = segment_bytes
        self._spaces: list[_Space] = []

    def put(self, data: np.ndarray) -> tuple[RegionSlice, Block]:
        """Copy `data`'s bytes (C order, as they are) into the arena: where they lie, and the block to free."""
        return self.put_rows((data,))

    def put_rows(self, parts: Sequence[np.ndarray]) -> tuple[RegionSlice, Block]:
        """`parts`' bytes one after another (one array's, or a group's rows of one input, gpud.frontproc.group):
        where they lie, and the block to free."""
        nbytes = sum(p.nbytes for p in parts)
        block = self._alloc(max(1, nbytes))
        offset = block.offset
        buf = block.space.segment.buf
        for part in parts:
            size = part.nbytes
            if not size:
                continue
            if part.ndim and part.flags.c_contiguous:  # (the usual: a request's rows as received) one memory copy
                buf[offset:offset + size] = part.data.cast("B")
            else:
                dest = block.space.segment.ndarray(offset, (size,), np.dtype(np.uint8))
                dest[...] = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            offset += size
        return RegionSlice("", block.space.path, block.offset, nbytes), block

    def _alloc(self, nbytes: int) -> Block:
        size = align(nbytes)
        for space in self._spaces:
            offset = space.take(size)
            if offset is not None:
                return self._reserved(Block(space, offset, size))
        # Pages are reserved as blocks reach them (first fit keeps to the start), not the whole segment at once.
        segment = Segment.create(new_segment_name(ARENA_TAG), max(self.segment_bytes, 2 * size), reserve=False)
        space = _Space(segment, segment_path(segment.name), [(0, segment.size_bytes)],
                       keep=not self._spaces and segment.size_bytes <= self.segment_bytes)
        self._spaces.append(space)
        offset = space.take(size)
        assert offset is not None
        return self._reserved(Block(space, offset, size))

    @staticmethod
    def _reserved(block: Block) -> Block:
        """The block, its pages reserved (shm.ShmFull, the block given back, when shared memory is full)."""
        try:
            block.space.segment.reserve(block.offset + block.size)
        except BaseException:
            block.space.give(block.offset, block.size)
            raise
        return block

    @staticmethod
    def free(block: Block) -> None:
        block.space.give(block.offset, block.size)

    def trim(self) -> int:
        """Release the pages of each segment (but the warm one) that stayed wholly free since the last trim; the
        bytes released."""
        released = 0
        for space in self._spaces:
            if space.keep or space.released or not space.empty:
                continue
            if space.used:
                space.used = False  # free now: released at the next trim unless taken from meanwhile
                continue
            space.segment.release_pages()
            space.released = True
            released += space.segment.size_bytes
        return released

    def close(self) -> None:
        for space in self._spaces:
            space.segment.close()
        self._spaces.clear()
