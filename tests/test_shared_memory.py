"""Triton's shared-memory extension over the wire, driven by tritonclient's own shared-memory utilities: inputs read
from and outputs written into a client's regions over HTTP and gRPC, text tensors, regions mixed with inline tensors,
status and unregistration; off unless --allow-client-shm; and hostile use (bad keys, offsets and sizes past a region,
a region truncated or unlinked by its client, an output larger than its space, a name registered twice), which gets
a clear error and leaves the daemon serving."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tests.daemon_harness import ADD_SUB_CONFIG, add_sub_model, save, start_daemon
from tests.ensemble_models import ensemble_config, save_model, step
from tests.test_text_tensors import CONFIG as ECHO_CONFIG
from tests.test_text_tensors import identity_model as echo_model

pytestmark = pytest.mark.slow
BYTES_16 = 16 * 4


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    save(add_sub_model(), repo, "add_sub", ADD_SUB_CONFIG)
    save(echo_model(), repo, "echo", ECHO_CONFIG)
    spec = [("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    out = [("OUTPUT0", "TYPE_FP32", [16]), ("OUTPUT1", "TYPE_FP32", [16])]
    save_model(repo, "add_sub_ensemble", None, ensemble_config(
        "add_sub_ensemble", spec, out, [step("add_sub", {"INPUT0": "INPUT0", "INPUT1": "INPUT1"},
                                             {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})], max_batch_size=8))
    return repo


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--allow-client-shm", "true")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(params=["http", "grpc"])
def client(request, daemon):
    if request.param == "http":
        c = httpclient.InferenceServerClient(daemon.http_url)
    else:
        c = grpcclient.InferenceServerClient(daemon.grpc_url)
    yield request.param, c
    c.unregister_system_shared_memory()
    c.close()


class Regions:
    """Client regions made with tritonclient's utilities, destroyed at the end."""

    def __init__(self):
        self.handles = []

    def make(self, byte_size: int):
        key = f"/gpud-test-{uuid.uuid4().hex[:12]}"
        name = key.strip("/").replace("gpud-test", "region")
        handle = shm.create_shared_memory_region(name, key.replace("/gpud-", "/client-"), byte_size)
        self.handles.append(handle)
        return name, key.replace("/gpud-", "/client-"), handle

    def close(self):
        for h in self.handles:
            try:
                shm.destroy_shared_memory_region(h)
            except Exception:  # noqa: BLE001 - a test unlinked it already
                pass


@pytest.fixture
def regions():
    r = Regions()
    yield r
    r.close()


def lib(kind):
    return httpclient if kind == "http" else grpcclient


def add_sub_inputs(kind, in_name, both_in_shm=True):
    m = lib(kind)
    inputs = [m.InferInput("INPUT0", [1, 16], "FP32"), m.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_shared_memory(in_name, BYTES_16)
    if both_in_shm:
        inputs[1].set_shared_memory(in_name, BYTES_16, offset=BYTES_16)
    return inputs


def outputs_in(kind, out_name):
    m = lib(kind)
    outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out_name, BYTES_16)
    outputs[1].set_shared_memory(out_name, BYTES_16, offset=BYTES_16)
    return outputs


def test_inputs_and_outputs_through_shared_memory(client, regions):
    kind, c = client
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.full((1, 16), 2.5, dtype=np.float32)
    in_name, in_key, in_handle = regions.make(2 * BYTES_16)
    out_name, out_key, out_handle = regions.make(2 * BYTES_16)
    shm.set_shared_memory_region(in_handle, [a, b])
    c.register_system_shared_memory(in_name, in_key, 2 * BYTES_16)
    c.register_system_shared_memory(out_name, out_key, 2 * BYTES_16)

    result = c.infer("add_sub", add_sub_inputs(kind, in_name), outputs=outputs_in(kind, out_name))

    out0 = result.get_output("OUTPUT0")
    shape0 = out0["shape"] if kind == "http" else list(out0.shape)
    assert shape0 == [1, 16]
    if kind == "http":  # the data went into the region, not into the answer
        assert "data" not in out0 and "parameters" not in out0
    else:
        assert result.get_response().raw_output_contents[0] == b""
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=BYTES_16), a - b)

    status = c.get_system_shared_memory_status()
    if kind == "http":
        by_name = {r["name"]: r for r in status}
        assert by_name[in_name] == {"name": in_name, "key": in_key, "offset": 0, "byte_size": 2 * BYTES_16}
    else:
        assert status.regions[in_name].key == in_key and status.regions[in_name].byte_size == 2 * BYTES_16
    c.unregister_system_shared_memory(in_name)
    status = c.get_system_shared_memory_status()
    names = [r["name"] for r in status] if kind == "http" else list(status.regions)
    assert names == [out_name]


def test_an_ensemble_reads_and_writes_shared_memory(client, regions):
    """An ensemble's request: the daemon reads its inputs from the regions and writes its outputs there (its steps
    run as any request's)."""
    kind, c = client
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    in_name, in_key, in_handle = regions.make(2 * BYTES_16)
    out_name, out_key, out_handle = regions.make(2 * BYTES_16)
    shm.set_shared_memory_region(in_handle, [a, -a])
    c.register_system_shared_memory(in_name, in_key, 2 * BYTES_16)
    c.register_system_shared_memory(out_name, out_key, 2 * BYTES_16)
    c.infer("add_sub_ensemble", add_sub_inputs(kind, in_name), outputs=outputs_in(kind, out_name))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]), np.zeros((1, 16)))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=BYTES_16), 2 * a)


def test_one_input_in_shared_memory_the_other_inline_and_outputs_in_the_answer(client, regions):
    kind, c = client
    a = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.float32)
    in_name, in_key, in_handle = regions.make(BYTES_16)
    shm.set_shared_memory_region(in_handle, [a])
    c.register_system_shared_memory(in_name, in_key, BYTES_16)
    inputs = add_sub_inputs(kind, in_name, both_in_shm=False)
    inputs[1].set_data_from_numpy(b)  # gRPC: the only raw_input_contents entry, for the second input
    result = c.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_text_tensors_through_shared_memory(client, regions):
    kind, c = client
    m = lib(kind)
    items = np.array([[b"", b"he\x00llo", "h\u00e9llo".encode(), b"x" * 100]], dtype=object)
    size = len(serialize_byte_tensor(items).item())
    in_name, in_key, in_handle = regions.make(size)
    out_name, out_key, out_handle = regions.make(size)
    shm.set_shared_memory_region(in_handle, [serialize_byte_tensor(items)])  # as Triton's own examples do
    c.register_system_shared_memory(in_name, in_key, size)
    c.register_system_shared_memory(out_name, out_key, size)
    inp = m.InferInput("TEXT", [1, 4], "BYTES")
    inp.set_shared_memory(in_name, size)
    out = m.InferRequestedOutput("ECHO")
    out.set_shared_memory(out_name, size)
    c.infer("echo", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.object_, [1, 4])
    assert list(got.reshape(-1)) == list(items.reshape(-1))


def test_many_requests_batch_together_and_each_gets_its_own_rows(daemon, regions):
    """Concurrent requests whose inputs and outputs are in several regions: each answer is its own."""
    c = httpclient.InferenceServerClient(daemon.http_url, concurrency=8)
    try:
        jobs = []
        for i in range(16):
            a = np.full((1, 16), i, dtype=np.float32)
            in_name, in_key, in_handle = regions.make(2 * BYTES_16)
            out_name, out_key, out_handle = regions.make(2 * BYTES_16)
            shm.set_shared_memory_region(in_handle, [a, a * 2])
            c.register_system_shared_memory(in_name, in_key, 2 * BYTES_16)
            c.register_system_shared_memory(out_name, out_key, 2 * BYTES_16)
            jobs.append((a, out_handle, c.async_infer("add_sub", add_sub_inputs("http", in_name),
                                                      outputs=outputs_in("http", out_name))))
        for a, out_handle, job in jobs:
            job.get_result()
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]), a * 3)
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16],
                                                                    offset=BYTES_16), -a)
    finally:
        c.unregister_system_shared_memory()
        c.close()


def test_a_region_unlinked_by_its_client_after_registering_still_works(daemon, regions):
    c = httpclient.InferenceServerClient(daemon.http_url)
    try:
        a = np.ones((1, 16), dtype=np.float32)
        in_name, in_key, in_handle = regions.make(2 * BYTES_16)
        shm.set_shared_memory_region(in_handle, [a, a])
        c.register_system_shared_memory(in_name, in_key, 2 * BYTES_16)
        os.unlink("/dev/shm" + in_key)  # the mapping lives on in the client, the registration in gpud
        result = c.infer("add_sub", add_sub_inputs("http", in_name))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
    finally:
        c.unregister_system_shared_memory()
        c.close()


# --- refused, and the daemon serves on ------------------------------------------------------------------------
def refused(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("key, why", [
    ("/no-such-region-here", "Unable to open shared memory region"),
    ("/../../etc/passwd", "is not a shared-memory object's name"),
    ("/gpud-1-in-0-abc", "gpud's own segments"),
    ("", "is not a shared-memory object's name"),
])
def test_bad_keys_are_refused(client, key, why):
    kind, c = client
    err = refused(c.register_system_shared_memory, "r", key, 64)
    assert why in err.message()
    assert err.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_a_symlink_in_dev_shm_is_refused(client, tmp_path):
    kind, c = client
    link = f"/dev/shm/client-link-{uuid.uuid4().hex[:8]}"
    os.symlink(tmp_path, link)
    try:
        err = refused(c.register_system_shared_memory, "r", link[len("/dev/shm"):], 64)
        assert "Unable to open shared memory region" in err.message()
    finally:
        os.unlink(link)


def test_registration_checks(client, regions):
    kind, c = client
    name, key, _ = regions.make(128)
    assert "past the end" in refused(c.register_system_shared_memory, name, key, 256).message()
    assert "past the end" in refused(c.register_system_shared_memory, name, key, 100, offset=64).message()
    c.register_system_shared_memory(name, key, 128)
    err = refused(c.register_system_shared_memory, name, key, 128)
    assert f"shared memory region '{name}' already in manager" in err.message()
    c.unregister_system_shared_memory("never-registered")  # nothing happens, as Triton
    err = refused(c.get_system_shared_memory_status, "never-registered")
    assert "Unable to find system shared memory region: 'never-registered'" in err.message()


def test_offsets_and_sizes_past_the_region_are_refused(client, regions):
    kind, c = client
    m = lib(kind)
    name, key, _ = regions.make(2 * BYTES_16)
    c.register_system_shared_memory(name, key, 2 * BYTES_16)
    inputs = add_sub_inputs(kind, name)
    inputs[1].set_shared_memory(name, BYTES_16, offset=2 * BYTES_16)
    assert "Invalid offset for shared memory region" in refused(c.infer, "add_sub", inputs).message()
    inputs[1].set_shared_memory(name, BYTES_16, offset=BYTES_16 + 4)
    assert "Invalid offset + byte size" in refused(c.infer, "add_sub", inputs).message()
    inputs[1].set_shared_memory(name, 32, offset=BYTES_16)  # fits the region, not the shape
    assert "needs 64" in refused(c.infer, "add_sub", inputs).message()
    inputs[1].set_shared_memory("no-such-region", BYTES_16)
    assert "Unable to find shared memory region: 'no-such-region'" in refused(c.infer, "add_sub", inputs).message()
    out = m.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory(name, 16)  # too small for 16 floats
    err = refused(c.infer, "add_sub", add_sub_inputs(kind, name), outputs=[out])
    assert "should be at least 64 bytes to hold the results" in err.message()
    np.testing.assert_array_equal(  # and it serves on
        c.infer("add_sub", [_inline(kind, "INPUT0"), _inline(kind, "INPUT1")]).as_numpy("OUTPUT0"),
        np.full((1, 16), 2, np.float32))


def _inline(kind, name):
    t = lib(kind).InferInput(name, [1, 16], "FP32")
    t.set_data_from_numpy(np.ones((1, 16), np.float32))
    return t


def test_a_region_truncated_by_its_client_fails_the_request_cleanly(client, regions):
    kind, c = client
    name, key, handle = regions.make(2 * BYTES_16)
    out_name, out_key, _ = regions.make(2 * BYTES_16)
    c.register_system_shared_memory(name, key, 2 * BYTES_16)
    c.register_system_shared_memory(out_name, out_key, 2 * BYTES_16)
    os.truncate("/dev/shm" + out_key, 8)  # the output's region shrinks under gpud
    err = refused(c.infer, "add_sub", add_sub_inputs(kind, name), outputs=outputs_in(kind, out_name))
    assert "truncated" in err.message()
    os.truncate("/dev/shm" + key, 8)  # now the input's
    err = refused(c.infer, "add_sub", add_sub_inputs(kind, name))
    assert "truncated" in err.message()
    assert c.is_server_live() and c.infer("add_sub", [_inline(kind, "INPUT0"), _inline(kind, "INPUT1")])


def test_data_and_shared_memory_together_are_refused(daemon):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16,
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64}},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]}
    status, doc = daemon.post_json("/v2/models/add_sub/infer", body, 30)
    assert status == 400 and "Input must set only one of the following fields" in doc["error"]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "r",
                                                           "shared_memory_byte_size": 64, "binary_data": True}}]}
    status, doc = daemon.post_json("/v2/models/add_sub/infer", body, 30)
    assert status == 400 and "Output can't set both 'shared_memory_region' and 'binary_data'" in doc["error"]


def test_cuda_shared_memory_without_a_gpu_says_so(client):
    kind, c = client
    err = refused(c.register_cuda_shared_memory, "cuda-region", b"\0" * 64, 0, 64)
    assert "CUDA shared memory needs a GPU" in err.message()
    status = c.get_cuda_shared_memory_status()
    assert (status == [] if kind == "http" else len(status.regions) == 0)


def test_server_metadata_lists_the_extensions(daemon):
    extensions = httpclient.InferenceServerClient(daemon.http_url).get_server_metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" in extensions


# --- off by default ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon_without_shm(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run-off"))
    yield d
    assert d.stop() == 0, d.log()


def test_off_unless_allowed(daemon_without_shm, regions):
    name, key, _ = regions.make(64)
    http = httpclient.InferenceServerClient(daemon_without_shm.http_url)
    err = refused(http.register_system_shared_memory, name, key, 64)
    assert err.status() == "501" and "--allow-client-shm=true" in err.message()
    grpc = grpcclient.InferenceServerClient(daemon_without_shm.grpc_url)
    err = refused(grpc.register_system_shared_memory, name, key, 64)
    assert err.status() == "StatusCode.UNIMPLEMENTED" and "--allow-client-shm=true" in err.message()
    assert http.get_system_shared_memory_status() == []
    inputs = add_sub_inputs("http", name)
    assert "--allow-client-shm=true" in refused(http.infer, "add_sub", inputs).message()
