"""A front-end process's arena gives memory back after a burst (gpud.frontproc.arena.Arena.trim): a segment that
stayed wholly free from one trim to the next has its pages released, the warm first segment never; the pages are
the machine's memory (tmpfs), so they are counted here as the file's allocated blocks."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpud.frontproc.arena import Arena

SEGMENT_BYTES = 1 << 20


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def arena():
    a = Arena(segment_bytes=SEGMENT_BYTES)
    yield a
    a.close()


def test_a_burst_segment_is_released_after_a_whole_trim_interval_free_and_serves_again(arena):
    small = np.ones(1000, np.uint8)
    warm_where, warm_block = arena.put(small)  # the first segment, of the default size: kept warm
    big = np.full(3 * SEGMENT_BYTES, 7, np.uint8)
    where, block = arena.put(big)  # no room: a segment of its own, twice its size
    assert where.path != warm_where.path
    if _allocated(where.path) < big.nbytes:
        pytest.skip("this filesystem does not report the pages a file holds")
    assert arena.trim() == 0  # in use
    arena.free(block)
    arena.free(warm_block)
    assert arena.trim() == 0  # free now: the next trim releases it, unless it is taken from meanwhile
    assert _allocated(where.path) >= big.nbytes
    released = arena.trim()
    assert released >= big.nbytes and _allocated(where.path) < SEGMENT_BYTES // 8
    assert _allocated(warm_where.path) > 0  # the warm segment keeps its pages
    assert arena.trim() == 0  # released once
    # the same segment serves again, its bytes as written
    again, block = arena.put(big)
    assert again.path == where.path
    with open(again.path, "rb") as f:
        assert os.pread(f.fileno(), again.byte_size, again.offset) == big.tobytes()


def test_a_segment_taken_from_between_trims_is_not_released(arena):
    arena.put(np.ones(10, np.uint8))  # warm segment
    _, first = arena.put(np.ones(2 * SEGMENT_BYTES, np.uint8))
    arena.free(first)
    assert arena.trim() == 0
    _, second = arena.put(np.ones(2 * SEGMENT_BYTES, np.uint8))  # taken from again before the next trim
    arena.free(second)
    assert arena.trim() == 0  # it was used since: another whole interval free first
    assert arena.trim() > 0


def test_a_segment_only_looked_at_for_a_larger_block_is_still_released(arena):
    arena.put(np.ones(10, np.uint8))  # warm segment
    _, middle = arena.put(np.ones(SEGMENT_BYTES, np.uint8))  # a segment of twice that
    arena.free(middle)  # wholly free from now on
    _, big = arena.put(np.ones(3 * SEGMENT_BYTES, np.uint8))  # too large for it: a segment of its own
    released = []
    for _ in range(3):  # steady large traffic: each allocation looks at the free segment and passes it by
        released.append(arena.trim())
        arena.free(big)
        _, big = arena.put(np.ones(3 * SEGMENT_BYTES, np.uint8))
    assert released == [0, 2 * SEGMENT_BYTES, 0]  # released once, at the second trim, and counted once


def test_rows_are_placed_byte_for_byte_whatever_their_layout(arena):
    """put_rows copies a C-contiguous part's memory as it is, and any other part (a strided view, a 0-d array)
    through numpy in C order: the bytes at the slice are the parts', one after another."""
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    parts = [rows[:1], rows[1:], np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2], np.array(True),
             np.frombuffer(b"\x01\x02\x03", np.uint8), np.zeros((0, 4), np.float32)]
    where, block = arena.put_rows(parts)
    expected = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    assert where.byte_size == len(expected)
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        assert f.read(where.byte_size) == expected
    arena.free(block)
