"""Loading a model with overrides (Triton's repository extension): a model configuration given in the load request
(`config`: model_config.proto as JSON) replaces config.pbtxt for that load, and model files given in it
(`file:<version>/<name>`) replace the model directory.

Files are written to a directory of gpud's own (`OverrideStore`, mode 0700), one per load, under a name gpud chooses:
never a path the request chooses (a file name with `..`, an absolute path or an empty part is refused). They stay
while the model serves from them (instances started later, a worker restart, read the model file again) and are
removed once the model is loaded again without them, or unloaded.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from google.protobuf import json_format

from gpud.proto import model_config_pb2 as pb
from gpud.repository.errors import ModelConfigError

CONFIG = "config"
FILE_PREFIX = "file:"
MAX_FILES = 256
CONFIG_SOURCE = "the load request's config"  # what errors in an override config name as their file
_VERSION_PATH = re.compile(r"^[0-9]+/")


@dataclass(frozen=True)
class LoadOverride:
    """What a load request brings: a config (JSON text) and files by their path in the model directory."""

    config_json: str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.files and self.config_json is None:
            raise ValueError("the 'config' parameter must be provided with 'file:' parameters: it is the model "
                             "configuration of the override model directory")
        if len(self.files) > MAX_FILES:
            raise ValueError(f"at most {MAX_FILES} 'file:' parameters, got {len(self.files)}")
        for path in self.files:
            check_file_path(path)

    def config_message(self, model_name: str) -> pb.ModelConfig:
        """The override config, parsed; ModelConfigError naming the problem (the name must be the model's or
        absent, as in Triton)."""
        message = pb.ModelConfig()
        try:
            json_format.Parse(self.config_json or "{}", message)
        except json_format.ParseError as e:
            raise ModelConfigError(CONFIG_SOURCE, f"not a model configuration: {e}") from None
        if message.name and message.name != model_name:
            raise ModelConfigError(CONFIG_SOURCE, f"name '{message.name}' does not match the model '{model_name}'")
        return message


def override_of(parameters: Mapping[str, object], file_bytes: Callable[[str, object], bytes]) -> LoadOverride | None:
    """The override a load request's parameters ask for (None: load from the repository), front-end neutral:
    `file_bytes(key, value)` turns a `file:` parameter's value into its bytes (HTTP: base64 text; gRPC: bytes), or
    raises ValueError. ValueError names the parameter at fault."""
    config = parameters.get(CONFIG)
    files = {key[len(FILE_PREFIX):]: file_bytes(key, value) for key, value in parameters.items()
             if key.startswith(FILE_PREFIX)}
    if config is None and not files:
        return None
    if config is not None and not isinstance(config, str):
        raise ValueError(f"'{CONFIG}' must be a string: the model configuration as JSON")
    return LoadOverride(config, files)


def check_file_path(path: str) -> None:
    """`<version>/<name>` inside the model directory: ValueError otherwise."""
    parts = path.split("/")
    if (not _VERSION_PATH.match(path) or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"'file:{path}': expected 'file:<version>/<file name>' inside the model directory")


class OverrideStore:
    """The model directories written for loads with files (see the module docstring). `root`: a directory gpud owns;
    default, a new one in the system's temporary directory."""

    def __init__(self, root: str | None = None):
        self._root = root
        self._count = itertools.count(1)
        self.dirs: dict[str, str] = {}  # model -> the directory it serves from now

    def root(self) -> str:
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="gpud-overrides-")
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        return self._root

    def write(self, name: str, files: Mapping[str, bytes]) -> str:
        """A new model directory named `name` holding `files`; returns its path."""
        model_dir = os.path.join(self.root(), f"load-{next(self._count)}", name)
        for path, data in files.items():
            check_file_path(path)
            target = os.path.join(model_dir, *path.split("/"))
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
        return model_dir

    def serving(self, name: str, model_dir: str | None) -> None:
        """Model `name` now serves from `model_dir` (None: the repository): the directory it served from before,
        if one of ours, is removed."""
        old = self.dirs.pop(name, None)
        if model_dir is not None:
            self.dirs[name] = model_dir
        if old is not None and old != model_dir:
            self.remove(old)

    def remove(self, model_dir: str) -> None:
        shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
