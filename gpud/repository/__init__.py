"""The model repository, split by job:

- `layout`: the Triton directory layout, scanning, and loading one model (`ModelRepository`, `ModelEntry`,
  `ModelLoadError`, version directories, the model file of a version);
- `config`: config.pbtxt -> the executor's typed `ModelConfig` and the `VersionPolicy`, with Triton's checks
  (`ModelConfigError`);
- `completion`: what the ONNX file adds to the configuration (its signature, Triton's auto-complete);
- `footprint`: the memory an instance needs, estimated from the ONNX file.

How a configuration looks on the wire is the front ends' business (`gpud.api`).
"""
