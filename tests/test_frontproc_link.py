"""The link's request and answer tuples (gpud.frontproc.link): what the front-end process gets back is what the core
answered (values, dtypes, shapes, writable arrays of their own; text as objects; a tensor in a client's region as no
data), and a placed input's empty data comes back as the same marker."""
from __future__ import annotations

import pickle

import numpy as np

from gpud.executor.client_shm import NO_DATA
from gpud.executor.types import InferRequest, InferResponse, InferTensor, RequestedOutput, ShmRef
from gpud.frontproc.link import request_of, request_wire, response_of, response_wire


def through_pickle(wire: tuple) -> tuple:
    return pickle.loads(pickle.dumps(wire, pickle.HIGHEST_PROTOCOL))


def test_an_answer_comes_back_as_it_was_given():
    batch = np.arange(48, dtype=np.float32).reshape(3, 16)
    text = np.array([b"a", b"bc"], dtype=object)
    big_endian = np.arange(4, dtype=">i4").reshape(2, 2)
    response = InferResponse("m", "1", [InferTensor("out", "FP32", (1, 16), batch[1:2]),
                                        InferTensor("text", "BYTES", (2,), text),
                                        InferTensor("be", "INT32", (2, 2), big_endian),
                                        InferTensor("in_region", "FP32", (4,), NO_DATA, ShmRef("r", 0, 16))],
                             id="7", parameters={"p": 1}, compute_ns=(1, 2, 3))
    back = response_of(through_pickle(response_wire(response)))
    assert (back.model_name, back.model_version, back.id, back.parameters, back.compute_ns) == \
        ("m", "1", "7", {"p": 1}, (1, 2, 3))
    out, text_back, be, in_region = back.outputs
    np.testing.assert_array_equal(out.data, batch[1:2])
    assert out.data.dtype == np.float32 and out.data.shape == (1, 16) and out.data.flags.writeable
    out.data[0, 0] = -1  # its own memory: the answer it came from is untouched
    assert batch[1, 0] == 16
    assert text_back.data.dtype == object and list(text_back.data) == [b"a", b"bc"]
    assert be.data.dtype == np.dtype(">i4")
    np.testing.assert_array_equal(be.data, big_endian)
    assert in_region.data is NO_DATA and in_region.shm == ShmRef("r", 0, 16)


def test_a_placed_input_keeps_its_marker_and_an_inline_one_its_data():
    inline = np.array([b"x"], dtype=object)
    request = InferRequest("m", [InferTensor("placed", "FP32", (1, 256), NO_DATA),
                                 InferTensor("inline", "BYTES", (1,), inline)],
                           outputs=[RequestedOutput("out", {"binary_data": True})], priority=2, timeout_us=5)
    back = request_of(through_pickle(request_wire(request)))
    assert back.inputs[0].data is NO_DATA and back.inputs[0].shape == (1, 256)
    assert list(back.inputs[1].data) == [b"x"]
    assert back.outputs == request.outputs and (back.priority, back.timeout_us) == (2, 5)


def test_a_turns_messages_go_as_one_frame_and_arrive_in_order(caplog):
    import asyncio
    import socket

    from gpud.frontproc.link import FrameReader, Sender

    async def main() -> list:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        got: list = []
        reader = FrameReader(theirs, got.append)
        sender = Sender(ours, lambda: None)
        sender.put(("a", 1))
        sender.put(("bad", lambda: None))  # cannot be pickled: dropped and logged, its turn's others still go
        sender.put(("b", 2))
        sender.put(("answer", 7, True, lambda: None))  # an answer that cannot go: its request hears why instead
        sender.put(("answers", [8, 9], True, lambda: None))  # a group's: each member hears why
        sender.flush()
        sender.put(("c", 3))
        sender.flush()
        reader.read()
        ours.close()
        theirs.close()
        return got

    got = asyncio.run(main())
    assert got[:2] == [("a", 1), ("b", 2)] and got[4] == ("c", 3)
    kind, ident, ok, error = got[2]
    assert (kind, ident, ok) == ("answer", 7, False) and "could not be sent to the front-end process" in error.message
    kind, idents, ok, error = got[3]
    assert (kind, idents, ok) == ("answers", [8, 9], False) and "could not be sent" in error.message
    assert "a 'bad' message to the other process could not be pickled" in caplog.text
