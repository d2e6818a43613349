"""Triton-compatible protobuf messages and the gRPC service, generated from the .proto files here.

Regenerate with `python scripts/gen_protos.py` (tests/test_protos_current.py checks the checked-in modules are current).

The generated modules register their descriptors in DESCRIPTOR_POOL, a pool of gpud's own, not in protobuf's default
pool: tritonclient registers Triton's files under the same names ("model_config.proto", "inference.ModelConfig"), and
the default pool refuses a second, different file of the same name, so a process that imports both (our tests, any tool
built on tritonclient) would fail at import. The wire format does not depend on the pool.
"""
from google.protobuf import descriptor_pool

DESCRIPTOR_POOL = descriptor_pool.DescriptorPool()
