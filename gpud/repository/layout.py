"""The model repository in Triton's layout, read the way Triton reads it.

    <repo>/<model>/config.pbtxt            optional: Triton's ModelConfig in protobuf text format
    <repo>/<model>/<version>/model.onnx    one directory per version (or config.default_model_filename)

`load_model` reads one model directory: its config.pbtxt (`gpud.repository.config`), the versions its policy
serves, and the configuration completed from the newest served version's ONNX file (`gpud.repository.completion`).
Every problem is a `ModelConfigError` that names the file at fault; a bad model never stops the others from loading
(`ModelRepository.scan`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpud.executor.model_config import ModelConfig
from gpud.proto import model_config_pb2 as pb
from gpud.repository.completion import DEFAULT_MAX_BATCH_SIZE, complete_config, load_onnx, onnx_signature
from gpud.repository.config import (DEFAULT_MODEL_FILENAME, VersionPolicy, config_from_proto, read_config_pbtxt,
    validate_model_config)
from gpud.repository.errors import ModelConfigError
from gpud.repository.overrides import CONFIG_SOURCE, LoadOverride, OverrideStore
from gpud.repository.ensemble import ensemble_config_from_proto, is_ensemble

CONFIG_FILENAME = "config.pbtxt"


# --------------------------------------------------------------------------------------------------------------------
# Scanning


def list_model_dirs(repo_path: str | os.PathLike[str]) -> list[str]:
    """Names of the model directories in a repository, sorted. Hidden directories (.git, ...) are not models."""
    with os.scandir(repo_path) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def available_versions(model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """Version numbers present under a model directory, ascending.

    As Triton: a version is a subdirectory whose name is a non-negative integer; names with a leading zero ("01")
    and non-numeric names are ignored.
    """
    versions = []
    with os.scandir(model_dir) as it:
        for e in it:
            if e.is_dir() and e.name.isdigit() and (e.name == "0" or not e.name.startswith("0")):
                versions.append(int(e.name))
    return tuple(sorted(versions))


def resolve_model_file(version_dir: str, filename: str) -> str:
    """The ONNX file of a version. Triton also accepts `model.onnx` as a directory (ONNX with external data)."""
    path = os.path.join(version_dir, filename)
    if os.path.isdir(path):
        inner = os.path.join(path, DEFAULT_MODEL_FILENAME)
        return inner if os.path.isfile(inner) else path
    return path



# --------------------------------------------------------------------------------------------------------------------
# Loading one model


@dataclass(frozen=True)
class ModelEntry:
    """A model that can be served: its complete config and the file of each version the policy selects."""

    name: str
    path: str  # the model directory
    versions: tuple[int, ...]  # ascending
    model_paths: dict[int, str]  # version -> ONNX file
    config: ModelConfig
    version_policy: VersionPolicy = VersionPolicy()
    config_path: str | None = None  # None: no config.pbtxt, everything came from the ONNX file
    # config.pbtxt as written (model_config.proto, serialized; b"" without one): the reported config keeps what it
    # sets that gpud does not change (an input's format, model_warmup, ...)
    source_config: bytes = b""
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # output -> its label_filename's lines

    @property
    def latest_version(self) -> int:
        return self.versions[-1]

    def model_path(self, version: int | None = None) -> str:
        """The ONNX file of `version` (None = the latest served). KeyError for a version that is not served."""
        return self.model_paths[self.latest_version if version is None else version]


@dataclass(frozen=True)
class ModelLoadError:
    """A model directory that could not be loaded, and why (for the repository index and logs)."""

    name: str
    path: str
    reason: str  # the ModelConfigError message: starts with the file at fault
    error: ModelConfigError | None = field(default=None, compare=False, repr=False)


MAX_LABELS_BYTES = 16 * 2**20  # a label file larger than this is refused (ImageNet's 1000 labels are ~30 KiB)


def read_labels(model_dir: str, message: pb.ModelConfig, blame: str) -> dict[str, tuple[str, ...]]:
    """Each output's label_filename (a file in the model directory, one label per line: line i names class i), as
    Triton reads them for the classification extension. ModelConfigError for a file that cannot be read."""
    labels = {}
    for output in message.output:
        filename = output.label_filename
        if not filename:
            continue
        parts = filename.replace("\\", "/").split("/")
        if os.path.isabs(filename) or ".." in parts:
            raise ModelConfigError(blame, f"output '{output.name}' label_filename '{filename}' must name a file in "
                                          "the model directory")
        path = os.path.join(model_dir, filename)
        try:
            if os.path.getsize(path) > MAX_LABELS_BYTES:
                raise ModelConfigError(path, f"label file over {MAX_LABELS_BYTES} bytes")
            with open(path, encoding="utf-8") as f:
                labels[output.name] = tuple(f.read().splitlines())
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ModelConfigError(path, f"output '{output.name}' label_filename: cannot read: {why}") from None
    return labels


def load_model(
    model_dir: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    config_message: pb.ModelConfig | None = None, config_source: str = ""
) -> ModelEntry:
    """Read one model directory: config.pbtxt (optional), version directories, auto-complete from the ONNX file.

    The config is completed from the newest served version's ONNX file; every served version's file must exist.
    `config_message` (a load request's override config, named `config_source` in errors) stands for config.pbtxt.
    """
    model_dir = os.fspath(model_dir)
    name = os.path.basename(os.path.normpath(model_dir))
    if not os.path.isdir(model_dir):
        raise ModelConfigError(model_dir, "model directory not found")
    config_path = config_source if config_message is not None else os.path.join(model_dir, CONFIG_FILENAME)
    has_config = config_message is not None or os.path.isfile(config_path)
    if config_message is not None:
        message = config_message
    else:
        message = read_config_pbtxt(config_path) if has_config else pb.ModelConfig()
    # Problems without a config file are the model directory's: there is no file to blame but the ONNX one.
    blame = config_path if has_config else model_dir
    ensemble = is_ensemble(message)
    config, policy = (ensemble_config_from_proto if ensemble else config_from_proto)(message, name, blame)

    present = available_versions(model_dir)
    if not present:
        expected = "an empty directory 1/ for an ensemble" if ensemble else f"1/{config.default_model_filename}"
        raise ModelConfigError(model_dir, f"no version directory (expected e.g. {expected})")
    versions = policy.select(present)
    if not versions:
        raise ModelConfigError(
            blame, f"version_policy {{ {policy} }} selects none of the versions present {list(present)}"
        )
    source = message.SerializeToString() if has_config else b""
    labels = read_labels(model_dir, message, blame)
    if ensemble:  # no model file: the config is complete as written (gpud.repository.ensemble checked it)
        return ModelEntry(name=name, path=model_dir, versions=versions, model_paths={}, config=config,
                          version_policy=policy, config_path=config_path, source_config=source, labels=labels)
    model_paths = {}
    for v in versions:
        version_dir = os.path.join(model_dir, str(v))
        path = resolve_model_file(version_dir, config.default_model_filename)
        if not os.path.isfile(path):
            raise ModelConfigError(version_dir, f"no model file '{config.default_model_filename}'")
        model_paths[v] = path

    newest = model_paths[versions[-1]]
    signature = onnx_signature(load_onnx(newest), newest)
    config = complete_config(
        config, signature, default_max_batch_size=default_max_batch_size, config_path=blame, model_path=newest
    )
    validate_model_config(config, blame)
    return ModelEntry(
        name=name,
        path=model_dir,
        versions=versions,
        model_paths=model_paths,
        config=config,
        version_policy=policy,
        config_path=config_path if has_config else None,
        source_config=source,
        labels=labels,
    )


def load_model_config(
    model_dir: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> ModelConfig:
    """The complete, validated config of one model directory (see `load_model`)."""
    return load_model(model_dir, default_max_batch_size=default_max_batch_size).config


class ModelRepository:
    """A Triton-layout model repository on disk. Reads it on every `scan()`; holds no other state."""

    def __init__(self, path: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 overrides: OverrideStore | None = None):
        self.path = os.fspath(path)
        self.default_max_batch_size = default_max_batch_size
        self.overrides = overrides if overrides is not None else OverrideStore()  # files of loads with overrides

    def model_names(self) -> list[str]:
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"model repository {self.path} is not a directory")
        return list_model_dirs(self.path)

    def load(self, name: str, override: LoadOverride | None = None) -> ModelEntry:
        """One model by name, or as a load request's `override` gives it (its config for config.pbtxt, its files,
        written to the override store, for the model directory). Raises ModelConfigError (also for a name that is
        not in the repository, when no files are given)."""
        if not name or os.sep in name or name.startswith("."):
            raise ModelConfigError(os.path.join(self.path, name), "not a model name")
        if override is None:
            return load_model(os.path.join(self.path, name), default_max_batch_size=self.default_max_batch_size)
        message = override.config_message(name)
        model_dir = self.overrides.write(name, override.files) if override.files else os.path.join(self.path, name)
        try:
            return load_model(model_dir, default_max_batch_size=self.default_max_batch_size, config_message=message,
                              config_source=CONFIG_SOURCE)
        except BaseException:
            if override.files:
                self.overrides.remove(model_dir)
            raise

    def scan(self) -> dict[str, ModelEntry | ModelLoadError]:
        """Every model directory, loaded or with the reason it could not be. One bad model never stops the rest."""
        result: dict[str, ModelEntry | ModelLoadError] = {}
        for name in self.model_names():
            model_dir = os.path.join(self.path, name)
            try:
                result[name] = self.load(name)
            except ModelConfigError as e:
                result[name] = ModelLoadError(name=name, path=model_dir, reason=str(e), error=e)
            except OSError as e:  # a directory that vanished or cannot be read while scanning
                err = ModelConfigError(e.filename or model_dir, f"cannot read: {e.strerror or e}")
                result[name] = ModelLoadError(name=name, path=model_dir, reason=str(err), error=err)
        return result
