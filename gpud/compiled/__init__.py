"""gpud's request path compiled to C (mypyc), used only while it matches the sources (issue 25, item 3).

The modules every request runs through (HTTP parsing and answering, routing, validation, the batcher, the
schedulers, the worker channel) are typed Python; mypyc compiles them into C extensions that run the same code
at ~15% less CPU per request on the loop (bench/serving/http_cost.py). `python -m gpud.compiled.build` makes them
(scripts/run and scripts/test do it when a C compiler is there) into `gpud/compiled/lib/`, with a manifest of each
source's hash.

`install()` (called by `gpud/__init__.py`, before anything else of gpud is imported) puts a finder on `sys.meta_path`
that loads those modules from `lib/` only when every source of gpud is the one the build was made from: the compiled
modules call each other directly and check the types the others declare, so one edited source makes the whole set
pure Python again, never a mix and never a stale build. Pure Python is what runs when there is no build, a stale
one, another Python, or `GPUD_PURE_PYTHON=1`; the behaviour is the same (both are tested), only the CPU per request
differs.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

# The request path, in import-name form. Edit with care: each must compile with mypyc (its attributes declared,
# no monkey-patching of its classes), and what these import from each other is bound at compile time.
MODULES: tuple[str, ...] = (
    "gpud.api.http_server", "gpud.api.http_api", "gpud.api.http_infer", "gpud.api.http_encode",
    "gpud.core", "gpud.registry", "gpud.executor.types",
    "gpud.executor.scheduler", "gpud.executor.dynamic_scheduler", "gpud.executor.batcher",
    "gpud.executor.channel", "gpud.executor.protocol", "gpud.executor.validation", "gpud.executor.stats",
    # front ends in processes of their own: the child's side (remote_core, link, arena, group) and the core's (host)
    "gpud.frontproc.remote_core", "gpud.frontproc.link", "gpud.frontproc.arena", "gpud.frontproc.group",
    "gpud.frontproc.host", "gpud.frontproc.connections",
    # gpud's own gRPC server: HTTP/2 framing, HPACK, calls, and the ModelInfer plans
    "gpud.api.grpcwire.connection", "gpud.api.grpcwire.calls", "gpud.api.grpcwire.frames",
    "gpud.api.grpcwire.hpack_decoder", "gpud.api.grpcwire.keepalive", "gpud.api.grpc_infer",
)
PURE_ENV = "GPUD_PURE_PYTHON"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds gpud/
LIB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
MANIFEST = "manifest.json"
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # what this Python loads (e.g. .cpython-311-x86_64-linux-gnu.so)


@dataclass(frozen=True)
class Status:
    compiled: bool
    reason: str  # what runs and why, for the daemon's log and `gpud --version`


_status = Status(False, "pure Python: gpud.compiled.install() was not called")
_REBUILD = "python -m gpud.compiled.build rebuilds it"


def source_path(module: str, root: str = PACKAGE_ROOT) -> str:
    return os.path.join(root, *module.split(".")) + ".py"


def source_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def source_hashes(root: str = PACKAGE_ROOT) -> dict[str, str]:
    """Every gpud source's hash, by its path under `root`: the compiled code checks the types the other modules
    declare too (a request's fields, a config's), so any edited source makes the build stale."""
    hashes = {}
    for directory, dirs, files in os.walk(os.path.join(root, "gpud")):
        dirs[:] = sorted(d for d in dirs if d not in ("lib", "lib.old", "__pycache__") and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                hashes[os.path.relpath(path, root)] = source_hash(path)
    return hashes


def decide(manifest: object, hashes: dict[str, str], ext_suffix: str, pure: bool, present: bool = True) -> Status:
    """Whether the build in `manifest` may be used (pure: the decision alone, no files read). `hashes`: every
    source's hash now (source_hashes); `present`: whether the build's files are all there."""
    if pure:
        return Status(False, f"pure Python ({PURE_ENV}=1)")
    if manifest is None:
        return Status(False, "pure Python: no compiled build (python -m gpud.compiled.build makes one)")
    try:
        assert isinstance(manifest, dict)
        if manifest["ext_suffix"] != ext_suffix:
            return Status(False, f"pure Python: the build is for {manifest['ext_suffix']}, this Python loads "
                                 f"{ext_suffix} ({_REBUILD})")
        if set(manifest["modules"]) != set(MODULES):
            return Status(False, f"pure Python: the build has another set of modules ({_REBUILD})")
        built: dict = manifest["sources"]
        changed = sorted(set(built) ^ set(hashes) | {p for p in set(built) & set(hashes) if built[p] != hashes[p]})
    except (AssertionError, KeyError, TypeError) as e:
        return Status(False, f"pure Python: the build's manifest is unreadable ({type(e).__name__}: {e}; "
                             f"{_REBUILD})")
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        return Status(False, f"pure Python: {changed[0]}{more} changed since the build ({_REBUILD})")
    if not present:
        return Status(False, f"pure Python: the build's files are incomplete ({_REBUILD})")
    return Status(True, f"compiled (mypyc): {len(MODULES)} modules of the request path")


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the compiled modules (and their shared library) from lib/; everything else is left to the others."""

    def __init__(self, paths: dict[str, str]):
        self.paths = paths

    def find_spec(self, fullname, path=None, target=None):
        so = self.paths.get(fullname)
        if so is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, so)
        return importlib.util.spec_from_file_location(fullname, so, loader=loader)


def read_manifest(lib_dir: str = LIB_DIR) -> dict | None:
    try:
        with open(os.path.join(lib_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _paths(manifest: dict, lib_dir: str) -> dict[str, str]:
    """The build's files by import name: the modules and their shared library."""
    paths = {name: os.path.join(lib_dir, entry["so"]) for name, entry in manifest["modules"].items()}
    paths.update({name: os.path.join(lib_dir, so) for name, so in manifest.get("libraries", {}).items()})
    return paths


def check(lib_dir: str = LIB_DIR, pure: bool = False) -> tuple[Status, dict[str, str]]:
    """Whether the build in `lib_dir` matches the sources and is whole, and its files by import name."""
    manifest = None if pure else read_manifest(lib_dir)
    if manifest is None:
        return decide(manifest, {}, EXT_SUFFIX, pure), {}
    try:
        paths = _paths(manifest, lib_dir)
    except (KeyError, TypeError, AttributeError) as e:
        return Status(False, f"pure Python: the build's manifest is unreadable ({type(e).__name__}: {e}; "
                             f"{_REBUILD})"), {}
    status = decide(manifest, source_hashes(), EXT_SUFFIX, pure,
                    present=all(os.path.exists(p) for p in paths.values()))
    return status, paths


def install() -> Status:
    """Use the compiled build if it matches the sources (once per process)."""
    global _status
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return _status
    try:
        _status, paths = check(pure=os.environ.get(PURE_ENV) == "1")
    except OSError as e:  # a source that cannot be read: nothing to compare the build with
        _status, paths = Status(False, f"pure Python: the sources cannot be read ({e})"), {}
    if _status.compiled:
        sys.meta_path.insert(0, _Finder(paths))
    return _status


def status() -> Status:
    return _status


def is_compiled(module_name: str) -> bool:
    """Whether an imported module runs compiled (its file is an extension)."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) or ""
    return file.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
