"""gpud.executor.client_shm alone: a region in use outlives its unregistration until its request finishes, the
limit on regions, the output written only into the space the request gave, and nothing left open at the end."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpud.executor.client_shm import ClientRegions
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.executor.types import ShmRef


@pytest.fixture
def regions(tmp_path):
    r = ClientRegions(allowed=True, max_regions=2, shm_dir=str(tmp_path))
    yield r
    r.close()


def region_file(tmp_path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return "/" + name


def request_using(region: str, nbytes: int, output: str | None = None) -> InferRequest:
    outputs = [RequestedOutput("y", shm=ShmRef(output, 0, nbytes))] if output else None
    return InferRequest("m", [InferTensor("x", "FP32", (nbytes // 4,), np.empty(0), ShmRef(region, 0, nbytes))],
                        outputs=outputs, uses_shm=True)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_region_unregistered_while_a_request_uses_it_closes_when_the_request_ends(regions, tmp_path):
    values = np.arange(4, dtype=np.float32)
    before = open_fds()
    regions.register("in", region_file(tmp_path, "in", values.tobytes()), 0, 16)
    regions.register("out", region_file(tmp_path, "out", bytes(16)), 0, 16)
    request = request_using("in", 16, output="out")
    staged = regions.stage(request)
    np.testing.assert_array_equal(request.inputs[0].data, values)  # read at staging
    regions.unregister()  # both names go at once ...
    assert regions.status() == [] and len(open_fds() - before) == 2  # ... their files stay open for the request
    response = InferResponse("m", "1", [InferTensor("y", "FP32", (4,), values * 2)])
    staged.answering(lambda result: None)(response)
    assert (tmp_path / "out").read_bytes() == (values * 2).tobytes()
    assert response.outputs[0].shm == ShmRef("out", 0, 16) and response.outputs[0].data.size == 0
    assert open_fds() == before


def test_a_request_refused_at_staging_holds_nothing(regions, tmp_path):
    regions.register("in", region_file(tmp_path, "in", bytes(16)), 0, 16)
    with pytest.raises(InferenceError, match="Unable to find shared memory region: 'gone'"):
        regions.stage(request_using("in", 16, output="gone"))
    regions.unregister("in")
    assert regions.status() == []  # and its file closed: nothing holds it
    with pytest.raises(InferenceError) as info:
        regions.stage(request_using("in", 16))
    assert info.value.kind is ErrorKind.NOT_FOUND


def test_regions_are_bounded(regions, tmp_path):
    key = region_file(tmp_path, "r", bytes(8))
    regions.register("a", key, 0, 8)
    regions.register("b", key, 0, 8)
    with pytest.raises(InferenceError, match="2 regions are registered, the most gpud keeps") as info:
        regions.register("c", key, 0, 8)
    assert info.value.kind is ErrorKind.UNAVAILABLE


def test_an_output_larger_than_its_space_is_refused_and_nothing_written(regions, tmp_path):
    regions.register("in", region_file(tmp_path, "in", bytes(16)), 0, 16)
    regions.register("out", region_file(tmp_path, "out", b"\xff" * 16), 0, 16)
    staged = regions.stage(request_using("in", 8, output="out"))
    results = []
    staged.answering(results.append)(InferResponse("m", "1", [InferTensor("y", "FP32", (4,), np.ones(4, np.float32))]))
    assert isinstance(results[0], InferenceError)
    assert "(8 bytes) should be at least 16 bytes to hold the results" in results[0].message
    assert (tmp_path / "out").read_bytes() == b"\xff" * 16


def test_disabled_refuses_registration_and_use_but_answers_status(tmp_path):
    regions = ClientRegions(shm_dir=str(tmp_path))
    with pytest.raises(InferenceError, match="--allow-client-shm=true") as info:
        regions.register("r", region_file(tmp_path, "r", bytes(8)), 0, 8)
    assert info.value.kind is ErrorKind.UNSUPPORTED
    with pytest.raises(InferenceError, match="--allow-client-shm=true"):
        regions.stage(request_using("r", 8))
    assert regions.status() == []


# --- the worker's side: run_batch reads clients' inputs into the batch and writes their outputs ---------------------
class Doubler:
    """A model: y = 2 * x."""

    provider = "test"

    def run(self, feed, names):
        return [feed["x"] * 2]


def test_the_worker_reads_client_inputs_and_writes_client_outputs_and_fails_only_the_request_whose_space_is_short(
        tmp_path):
    from gpud.executor.model_config import ModelConfig, TensorSpec
    from gpud.executor.protocol import Done, Infer, read_outputs, write_inputs
    from gpud.executor.shm import Segment, new_segment_name
    from gpud.executor.types import RegionSlice
    from gpud.executor.worker import run_batch

    config = ModelConfig(name="double", platform="", backend="fake", max_batch_size=4,
                         inputs=[TensorSpec("x", "FP32", (2,))], outputs=[TensorSpec("y", "FP32", (2,))])
    a = np.array([[1, 2]], np.float32)
    b = np.array([[3, 4], [5, 6]], np.float32)
    (tmp_path / "in").write_bytes(b.tobytes())
    (tmp_path / "out-a").write_bytes(bytes(8))
    (tmp_path / "out-b").write_bytes(bytes(8))  # too short for b's two rows
    in_seg = Segment.create(new_segment_name("in"), 4096)
    out_seg = Segment.create(new_segment_name("out"), 4096)
    try:
        # request a inline, request b from a region; b's zero-stride placeholder is never copied
        b_slice = RegionSlice("in", str(tmp_path / "in"), 0, b.nbytes)
        rows, reads = write_inputs(config, [{"x": a}, {"x": np.broadcast_to(np.float32(0), (2, 2))}],
                                   lambda n: in_seg, [None, {"x": b_slice}])
        assert reads == ((8, str(tmp_path / "in"), 0, 16, 1),)  # the last: the request's index in the batch
        writes = ((0, 0, 1, str(tmp_path / "out-a"), 0, 8, 0), (0, 1, 3, str(tmp_path / "out-b"), 0, 8, 1))
        done = run_batch(Doubler(), {in_seg.name: in_seg, out_seg.name: out_seg}.__getitem__,
                         Infer("k", in_seg.name, out_seg.name, rows, ("y",), ("FP32",), 1, reads, writes))
        assert isinstance(done, Done)
        assert (tmp_path / "out-a").read_bytes() == (a * 2).tobytes()
        assert (tmp_path / "out-b").read_bytes() == bytes(8)  # nothing written where it does not fit
        assert [(i, kind) for i, kind, _ in done.write_errors] == [(1, "INVALID_ARGUMENT")]
        assert "should be at least 16 bytes" in done.write_errors[0][2]
        assert done.outputs[0].offset == -1  # every row went to a region: nothing staged for the daemon
        [(name, _, y)] = read_outputs(done, out_seg)
        assert y.shape == (3, 2) and y.strides == (0, 0)  # its shape only
    finally:
        in_seg.close()
        out_seg.close()


def test_a_requests_inputs_in_shared_memory_are_bounded_as_a_body_is(tmp_path):
    regions = ClientRegions(allowed=True, shm_dir=str(tmp_path), max_request_bytes=8)
    regions.register("in", region_file(tmp_path, "in", bytes(16)), 0, 16)
    with pytest.raises(InferenceError, match="add up to 16 bytes, more than the limit of 8 \\(--max-request-bytes\\)"):
        regions.stage(request_using("in", 16))
    regions.unregister()
    assert regions.status() == []
    regions.close()


def test_an_input_that_cannot_be_read_fails_its_request_alone_and_its_batch_mates_are_answered(tmp_path):
    """Three requests batched, each input in a client's region: the middle one's file was truncated after the core
    staged it (between its check and the worker's read). Before, the read raised and failed the whole batch, so one
    client's truncation failed every request it was batched with."""
    from gpud.executor.model_config import ModelConfig, TensorSpec
    from gpud.executor.protocol import Done, Infer, read_outputs, write_inputs
    from gpud.executor.shm import Segment, new_segment_name
    from gpud.executor.types import RegionSlice
    from gpud.executor.worker import run_batch

    config = ModelConfig(name="double", platform="", backend="fake", max_batch_size=4,
                         inputs=[TensorSpec("x", "FP32", (2,))], outputs=[TensorSpec("y", "FP32", (2,))])
    rows = [np.array([[1, 2]], np.float32), np.array([[3, 4]], np.float32), np.array([[5, 6]], np.float32)]
    for i, row in enumerate(rows):
        (tmp_path / f"in{i}").write_bytes(row.tobytes())
        (tmp_path / f"out{i}").write_bytes(bytes(8))
    (tmp_path / "in1").write_bytes(b"\x01\x02")  # truncated by its client
    in_seg = Segment.create(new_segment_name("in"), 4096)
    out_seg = Segment.create(new_segment_name("out"), 4096)
    try:
        slices = [{"x": RegionSlice(f"r{i}", str(tmp_path / f"in{i}"), 0, 8)} for i in range(3)]
        placeholders = [{"x": np.broadcast_to(np.float32(0), (1, 2))} for _ in range(3)]
        metas, reads = write_inputs(config, placeholders, lambda n: in_seg, slices)
        writes = tuple((0, i, i + 1, str(tmp_path / f"out{i}"), 0, 8, i) for i in range(3))
        done = run_batch(Doubler(), {in_seg.name: in_seg, out_seg.name: out_seg}.__getitem__,
                         Infer("k", in_seg.name, out_seg.name, metas, ("y",), ("FP32",), 1, reads, writes))
        assert isinstance(done, Done), done
        assert [(i, kind) for i, kind, _ in done.read_errors] == [(1, "INVALID_ARGUMENT")]
        assert "the client truncated it" in done.read_errors[0][2]
        assert (tmp_path / "out0").read_bytes() == (rows[0] * 2).tobytes()
        assert (tmp_path / "out2").read_bytes() == (rows[2] * 2).tobytes()
        assert (tmp_path / "out1").read_bytes() == bytes(8), "nothing written for the request that failed"
        assert done.write_errors == ()
        [(_, _, y)] = read_outputs(done, out_seg)  # not every row went to a region: the output is staged too
        assert y.shape == (3, 2)
    finally:
        in_seg.close()
        out_seg.close()


def test_a_write_into_a_region_gone_meanwhile_fails_its_request_with_unavailable(tmp_path):
    """The worker's write errors keep their kind: a region whose file is gone is UNAVAILABLE (503), not a 400."""
    from gpud.executor.model_config import ModelConfig, TensorSpec
    from gpud.executor.protocol import Done, Infer, write_inputs
    from gpud.executor.shm import Segment, new_segment_name
    from gpud.executor.worker import run_batch

    config = ModelConfig(name="double", platform="", backend="fake", max_batch_size=4,
                         inputs=[TensorSpec("x", "FP32", (2,))], outputs=[TensorSpec("y", "FP32", (2,))])
    in_seg = Segment.create(new_segment_name("in"), 4096)
    out_seg = Segment.create(new_segment_name("out"), 4096)
    try:
        metas, reads = write_inputs(config, [{"x": np.ones((1, 2), np.float32)}], lambda n: in_seg)
        writes = ((0, 0, 1, str(tmp_path / "gone"), 0, 8, 0),)
        done = run_batch(Doubler(), {in_seg.name: in_seg, out_seg.name: out_seg}.__getitem__,
                         Infer("k", in_seg.name, out_seg.name, metas, ("y",), ("FP32",), 1, reads, writes))
        assert isinstance(done, Done)
        assert [(i, kind) for i, kind, _ in done.write_errors] == [(0, "UNAVAILABLE")]
    finally:
        in_seg.close()
        out_seg.close()
