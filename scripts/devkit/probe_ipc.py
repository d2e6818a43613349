"""CUDA IPC through cuda.bindings: a parent allocates and writes, a child opens the handle, reads, writes back."""
import base64
import subprocess
import sys
import time

import numpy as np
from cuda.bindings import runtime as rt
import cuda.bindings

OK = rt.cudaError_t.cudaSuccess


def ck(r):
    if r[0] != OK:
        raise RuntimeError(f"{r[0]!r}")
    return r[1] if len(r) == 2 else r[1:]


def pattern(n):
    return (np.arange(n) % 251).astype(np.uint8)


if len(sys.argv) > 1:
    raw, n = base64.b64decode(sys.argv[1]), int(sys.argv[2])
    print("child: device count", ck(rt.cudaGetDeviceCount()))
    ck(rt.cudaSetDevice(0))
    h = rt.cudaIpcMemHandle_t()
    h.reserved = raw
    t = time.perf_counter()
    ptr = ck(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess))
    print("child: open", type(ptr), int(ptr), f"{(time.perf_counter() - t) * 1e3:.2f} ms")
    r2 = rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
    print("child: second open of the same handle ->", r2[0], int(r2[1]) if r2[0] == OK else None)
    host = np.empty(n, np.uint8)
    t = time.perf_counter()
    ck(rt.cudaMemcpy(host.ctypes.data, ptr, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    dt = time.perf_counter() - t
    print("child: read ok", bool((host == pattern(n)).all()), f"DtoH {n / dt / 1e9:.2f} GB/s pageable")
    out = (255 - host).astype(np.uint8)
    ck(rt.cudaMemcpy(int(ptr) + 0, out.ctypes.data, n, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
    attrs = rt.cudaPointerGetAttributes(ptr)
    print("child: attrs", attrs[0], getattr(attrs[1], "type", None), getattr(attrs[1], "device", None))
    ck(rt.cudaDeviceSynchronize())
    print("child: close", rt.cudaIpcCloseMemHandle(ptr)[0])
    if r2[0] == OK:
        print("child: close second", rt.cudaIpcCloseMemHandle(r2[1])[0])
    bad = rt.cudaIpcMemHandle_t()
    bad.reserved = bytes(64)
    print("child: zero handle ->", rt.cudaIpcOpenMemHandle(bad, rt.cudaIpcMemLazyEnablePeerAccess)[0])
    junk = rt.cudaIpcMemHandle_t()
    junk.reserved = bytes(range(64))
    print("child: junk handle ->", rt.cudaIpcOpenMemHandle(junk, rt.cudaIpcMemLazyEnablePeerAccess)[0])
    print("child: last error after failures", rt.cudaGetLastError()[0])
    sys.exit(0)

print("cuda.bindings", cuda.bindings.__version__, "driver", ck(rt.cudaDriverGetVersion()), "runtime",
      ck(rt.cudaRuntimeGetVersion()))
n = 64 << 20
ptr = ck(rt.cudaMalloc(n))
src = pattern(n)
ck(rt.cudaMemcpy(ptr, src.ctypes.data, n, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
h = ck(rt.cudaIpcGetMemHandle(ptr))
raw = h.reserved
print("parent: reserved", type(raw), len(raw), type(raw[0]) if len(raw) else None)
raw_b = bytes(bytearray(x & 0xFF for x in raw)) if not isinstance(raw, (bytes, bytearray)) else bytes(raw)
hi = rt.cudaIpcGetMemHandle(int(ptr) + 4096)
print("parent: handle of an interior pointer ->", hi[0], (bytes(bytearray(x & 0xFF for x in hi[1].reserved)) == raw_b)
      if hi[0] == OK else None)
res = subprocess.run([sys.executable, __file__, base64.b64encode(raw_b).decode(), str(n)], capture_output=True,
                     text=True, timeout=60)
print(res.stdout, res.stderr[-3000:])
back = np.empty(n, np.uint8)
ck(rt.cudaMemcpy(back.ctypes.data, ptr, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
print("parent: child's write seen", bool((back == (255 - pattern(n)).astype(np.uint8)).all()))
try:
    import cupy
    a = cupy.arange(16, dtype=cupy.float32)
    hc = cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr)
    print("cupy ipc handle", type(hc), len(hc))
except Exception as e:
    print("cupy", e)
ck(rt.cudaFree(ptr))
