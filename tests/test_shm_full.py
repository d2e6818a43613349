"""A full /dev/shm (a container's is 64 MiB unless told otherwise) is an error for the one load, batch or request that
needs more, never a dead daemon: a write through a mapping into a full tmpfs is a SIGBUS that kills the writing
process, so gpud reserves a segment's pages (posix_fallocate) before writing them (gpud.executor.shm.ShmFull)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from gpud.executor import shm
from gpud.executor.shm import Segment, ShmFull, new_segment_name, segment_path
from gpud.frontproc.arena import Arena
from tests.daemon_harness import save, start_daemon


@pytest.fixture
def fallocate_calls(monkeypatch):
    """posix_fallocate recorded; it fails with ENOSPC while `full[0]` is set."""
    calls: list[tuple[int, int]] = []
    full = [False]
    real = os.posix_fallocate

    def fake(fd: int, start: int, length: int) -> None:
        calls.append((start, length))
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, start, length)
    monkeypatch.setattr(shm.os, "posix_fallocate", fake)
    return calls, full


def test_a_segment_without_room_is_an_error_that_says_what_to_do_and_leaves_no_file(fallocate_calls):
    calls, full = fallocate_calls
    full[0] = True
    name = new_segment_name("t")
    with pytest.raises(ShmFull) as info:
        Segment.create(name, 1 << 20)
    assert info.value.errno == errno.ENOSPC and "--shm-size" in str(info.value) and "[Errno" not in str(info.value)
    assert not os.path.exists(segment_path(name))
    assert calls == [(0, 1 << 20)]


def test_pages_are_reserved_once_each_from_the_start_and_again_after_they_are_released(fallocate_calls):
    calls, _ = fallocate_calls
    seg = Segment.create(new_segment_name("t"), 1 << 20, reserve=False)
    try:
        assert calls == [] and seg.reserved_bytes == 0
        seg.reserve(4096)
        seg.reserve(1000)  # within what is reserved: no call
        seg.reserve(10 << 20)  # past its end: up to its end
        assert calls == [(0, 4096), (4096, (1 << 20) - 4096)] and seg.reserved_bytes == 1 << 20
        seg.release_pages()
        seg.reserve(4096)
        assert calls[-1] == (0, 4096)
    finally:
        seg.close()


def test_an_arena_without_room_gives_the_block_back_and_serves_once_there_is_room(fallocate_calls):
    calls, full = fallocate_calls
    arena = Arena(segment_bytes=1 << 20)
    try:
        where, block = arena.put(np.ones(1000, np.float32))
        full[0] = True
        with pytest.raises(ShmFull):
            arena.put(np.ones(10_000, np.float32))  # past the pages reserved: no room
        full[0] = False
        again, block2 = arena.put(np.ones(10_000, np.float32))
        assert again.offset == where.offset + 4032  # the failed one's block was given back: the same place
        assert calls[0] == (0, 4032) and calls[-1] == (4032, 40000)
        Arena.free(block)
        Arena.free(block2)
    finally:
        arena.close()


# --- a real daemon whose /dev/shm is small -------------------------------------------------------------------------
# Python's arguments that run gpud's main in a mount namespace of its own with a 24 MiB tmpfs on /dev/shm (as a
# container gets): unshare(2) and mount(2) through libc (os.unshare is Python 3.12's).
_SMALL_SHM = textwrap.dedent("""
    import ctypes, os, runpy, sys
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare")
    if libc.mount(b"none", b"/", None, (1 << 14) | (1 << 18), None) != 0:  # MS_REC | MS_PRIVATE
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=24m") != 0:
        raise OSError(ctypes.get_errno(), "mount tmpfs")
    if len(sys.argv) > 1:
        sys.argv = ["gpud", *sys.argv[1:]]
        runpy.run_module("gpud.main", run_name="__main__", alter_sys=True)
""")


def _can_mount_small_shm() -> bool:
    if sys.platform != "linux":
        return False
    probe = subprocess.run([sys.executable, "-c", _SMALL_SHM], capture_output=True, timeout=30)
    return probe.returncode == 0


def _identity(dims: list) -> object:
    t = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, dims)  # noqa: E731
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [t("x")], [t("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_a_daemon_whose_shared_memory_is_too_small_refuses_what_does_not_fit_and_keeps_serving(tmp_path):
    if not _can_mount_small_shm():
        pytest.skip("needs the right to mount a small tmpfs on /dev/shm in a mount namespace (root)")
    repo = tmp_path / "models"
    # one full batch: 64 rows of 256 KiB in, as much out: 32 MiB, more than the 24 MiB there is (smaller ones fit)
    save(_identity(["b", 65536]), repo, "wide", 'max_batch_size: 64\n'
         'input [ { name: "x" data_type: TYPE_FP32 dims: [ 65536 ] } ]\n'
         'output [ { name: "y" data_type: TYPE_FP32 dims: [ 65536 ] } ]\n')
    # variable length: regions of 1 MiB that grow with the batch
    save(_identity([-1]), repo, "var", 'max_batch_size: 0\n'
         'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
         'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    daemon = start_daemon(repo, tmp_path, "--max-request-bytes", str(128 << 20), node=None,
                          launch=("-c", _SMALL_SHM))
    try:
        status, body = daemon.post_json("/v2/repository/index", {})
        assert status == 200 and all(m["state"] == "READY" for m in body), body
        # said at load: what a full batch would take against what is free
        assert "instance wide" in daemon.log() and "a full batch takes 32.0 MiB of shared memory" in daemon.log()
        client = httpclient.InferenceServerClient(daemon.http_url, network_timeout=120)

        def infer(model: str, shape: list[int]) -> np.ndarray:
            x = httpclient.InferInput("x", shape, "FP32")
            x.set_data_from_numpy(np.full(shape, 1.5, np.float32), binary_data=True)
            return client.infer(model, [x]).as_numpy("y")
        for model, shape in (("var", [8 << 20]), ("wide", [64, 65536])):  # 32 MiB in; 16 MiB in and 16 out
            with pytest.raises(InferenceServerException) as info:
                infer(model, shape)
            assert "--shm-size" in str(info.value) and info.value.status() == "503", info.value
        # what fits is served, by the same daemon
        np.testing.assert_array_equal(infer("var", [1000]), np.full(1000, 1.5, np.float32))
        np.testing.assert_array_equal(infer("wide", [4, 65536]), np.full((4, 65536), 1.5, np.float32))
        assert daemon.proc.poll() is None
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_an_answer_that_cannot_be_staged_whole_leaves_no_segment_behind(monkeypatch):
    """A front end's answer with two large outputs, the second with no room: the first's segment, made already, is
    removed (the front end never hears of either), and the front-end host is told of none."""
    from gpud.executor.types import InferResponse, InferTensor
    from gpud.frontproc.link import response_wire

    real = os.posix_fallocate
    made: list[int] = []

    def second_fails(fd: int, start: int, length: int) -> None:
        made.append(length)
        if len(made) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, start, length)
    monkeypatch.setattr(shm.os, "posix_fallocate", second_fails)
    mine = f"gpud-{os.getpid()}-answer-"
    before = {n for n in os.listdir(shm.shm_dir()) if n.startswith(mine)}
    big = np.ones(1 << 15, np.float32)  # 128 KiB: handed over in a segment of its own
    answer = InferResponse("m", "1", [InferTensor("a", "FP32", big.shape, big), InferTensor("b", "FP32", big.shape, big)])
    handed: list[str] = []
    with pytest.raises(ShmFull):
        response_wire(answer, handed.append)
    assert len(made) == 2 and handed == []
    assert {n for n in os.listdir(shm.shm_dir()) if n.startswith(mine)} == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOMEM])  # ENOMEM: a memory cgroup's limit (a pod's emptyDir)
def test_no_pages_for_either_reason_is_shm_full(monkeypatch, code):
    def fails(fd: int, start: int, length: int) -> None:
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(shm.os, "posix_fallocate", fails)
    with pytest.raises(ShmFull):
        Segment.create(new_segment_name("t"), 4096)


def test_a_segment_removed_by_its_owner_meanwhile_is_not_an_error_to_reserve():
    seg = Segment.create(new_segment_name("t"), 1 << 16, reserve=False)
    attached = Segment.attach(seg.name)
    try:
        seg.close()  # the owner removes the file (an instance unloaded while its batch ran)
        attached.reserve(4096)  # the worker's write into its mapping goes on: nobody reads it
        assert attached.reserved_bytes == 0
    finally:
        attached.close()


def test_a_clients_region_on_a_full_shm_fails_that_output_with_unavailable(tmp_path, monkeypatch):
    from gpud.executor import client_shm
    from gpud.executor.types import ErrorKind, InferenceError

    region = tmp_path / "region"
    region.write_bytes(b"\0" * 4096)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(client_shm.os, "pwritev", full)
    with pytest.raises(InferenceError) as info:
        client_shm.write_blob(str(region), 0, 4096, memoryview(b"x" * 16), "y")
    assert info.value.kind is ErrorKind.UNAVAILABLE and "--shm-size" in info.value.message


def test_an_answer_that_does_not_fit_for_its_front_end_is_unavailable_not_a_bug():
    from gpud.executor.types import ErrorKind
    from gpud.frontproc.host import _unstaged

    error = _unstaged(ShmFull(errno.ENOSPC, "no room in shared memory (/dev/shm) for 1 more bytes"))
    assert error.kind is ErrorKind.UNAVAILABLE and "no room in shared memory" in error.message
    assert _unstaged(ValueError("a bug")).kind is ErrorKind.INTERNAL
