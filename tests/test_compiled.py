"""The compiled request path (gpud.compiled): used only while it matches the sources, never a stale build."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from gpud import compiled

SUFFIX = compiled.EXT_SUFFIX
SOURCES = {f"gpud/m{i}.py": f"hash-{i}" for i in range(5)}


def manifest(sources: dict[str, str] = SOURCES, suffix: str = SUFFIX, modules=compiled.MODULES) -> dict:
    return {"ext_suffix": suffix, "modules": {m: {"so": f"{m}.so"} for m in modules}, "libraries": {},
            "sources": dict(sources)}


def test_a_build_that_matches_every_source_is_used():
    status = compiled.decide(manifest(), SOURCES, SUFFIX, pure=False)
    assert status.compiled and "compiled (mypyc)" in status.reason


def test_one_changed_source_makes_the_whole_set_pure_python_and_says_which():
    now = dict(SOURCES, **{"gpud/m3.py": "edited"})
    status = compiled.decide(manifest(), now, SUFFIX, pure=False)
    assert not status.compiled
    assert "gpud/m3.py changed since the build" in status.reason
    assert "python -m gpud.compiled.build" in status.reason


def test_a_source_added_removed_or_several_changed_are_changes_too():
    assert "gpud/new.py changed" in compiled.decide(manifest(), dict(SOURCES, **{"gpud/new.py": "x"}), SUFFIX,
                                                    pure=False).reason
    fewer = dict(SOURCES)
    del fewer["gpud/m0.py"]
    assert "gpud/m0.py changed" in compiled.decide(manifest(), fewer, SUFFIX, pure=False).reason
    status = compiled.decide(manifest(), {p: "edited" for p in SOURCES}, SUFFIX, pure=False)
    assert not status.compiled and f"and {len(SOURCES) - 1} more" in status.reason


def test_no_build_another_python_another_module_set_missing_files_and_the_switch_are_pure_python():
    assert "no compiled build" in compiled.decide(None, SOURCES, SUFFIX, pure=False).reason
    other = compiled.decide(manifest(suffix=".cpython-313t-x86_64-linux-gnu.so"), SOURCES, SUFFIX, pure=False)
    assert not other.compiled and "cpython-313t" in other.reason
    assert not compiled.decide(manifest(modules=compiled.MODULES[1:]), SOURCES, SUFFIX, pure=False).compiled
    incomplete = compiled.decide(manifest(), SOURCES, SUFFIX, pure=False, present=False)
    assert not incomplete.compiled and "incomplete" in incomplete.reason
    pure = compiled.decide(manifest(), SOURCES, SUFFIX, pure=True)
    assert not pure.compiled and compiled.PURE_ENV in pure.reason


@pytest.mark.parametrize("broken", [[], {"ext_suffix": SUFFIX}, {"ext_suffix": SUFFIX, "modules": 3, "sources": {}},
                                    {"ext_suffix": SUFFIX, "modules": {m: {} for m in compiled.MODULES},
                                     "sources": None}])
def test_a_manifest_of_another_shape_is_pure_python_not_a_failed_import(broken, tmp_path):
    assert not compiled.decide(broken, SOURCES, SUFFIX, pure=False).compiled
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(broken))
    status, _ = compiled.check(str(tmp_path))
    assert not status.compiled and status.reason.startswith("pure Python")


def test_a_missing_or_unreadable_manifest_reads_as_none(tmp_path):
    assert compiled.read_manifest(str(tmp_path)) is None
    (tmp_path / compiled.MANIFEST).write_text("{not json")
    assert compiled.read_manifest(str(tmp_path)) is None
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest()))
    assert compiled.read_manifest(str(tmp_path)) == manifest()


def test_a_build_whose_files_are_gone_is_incomplete(tmp_path):
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest(compiled.source_hashes())))
    status, _ = compiled.check(str(tmp_path))
    assert not status.compiled and "incomplete" in status.reason


def test_every_source_of_gpud_is_hashed_and_a_build_is_not():
    hashes = compiled.source_hashes()
    assert "gpud/api/http_server.py" in hashes and "gpud/executor/types.py" in hashes
    assert not [p for p in hashes if "/compiled/lib" in p or not p.endswith(".py")]


def _probe(env: dict[str, str]) -> dict:
    code = ("import json, gpud, gpud.api.http_server, gpud.executor.batcher\n"
            "from gpud import compiled\n"
            "print(json.dumps({'compiled': compiled.status().compiled, 'reason': compiled.status().reason,"
            " 'loaded': [m for m in compiled.MODULES if compiled.is_compiled(m)]}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_runs_the_build_when_it_matches_and_pure_python_when_told():
    """With a build that matches (scripts/test makes one; GPUD_EXPECT_COMPILED=1 says it did), the request path's
    modules load compiled; with GPUD_PURE_PYTHON=1, none does."""
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    got = _probe(env)
    if not got["compiled"]:
        if os.environ.get("GPUD_EXPECT_COMPILED") == "1":
            pytest.fail(f"scripts/test built the request path, but it does not load: {got['reason']}")
        pytest.skip(f"no usable build here: {got['reason']}")
    assert "gpud.api.http_server" in got["loaded"] and "gpud.executor.batcher" in got["loaded"]
    pure = _probe(dict(env, **{compiled.PURE_ENV: "1"}))
    assert not pure["compiled"] and pure["loaded"] == []


def test_the_build_says_what_is_missing_instead_of_failing_obscurely(monkeypatch, capsys):
    from gpud.compiled import build

    monkeypatch.setattr(build, "_missing", lambda: "no C compiler (cc) on PATH: install gcc or clang")
    monkeypatch.setattr(build, "build", lambda **kw: pytest.fail("must not build"))
    assert build.main(["--quiet"]) == 1
    assert "not built, gpud runs as pure Python: no C compiler" in capsys.readouterr().err


def test_if_stale_does_nothing_when_the_build_matches(monkeypatch, capsys):
    from gpud.compiled import build

    monkeypatch.setattr(compiled, "check", lambda lib_dir=compiled.LIB_DIR, pure=False: (
        compiled.Status(True, "compiled"), {}))
    monkeypatch.setattr(build, "build", lambda **kw: pytest.fail("must not build"))
    assert build.main(["--if-stale"]) == 0
    assert "matches the sources" in capsys.readouterr().out


class _Compiler:
    """distutils' compiler as compile_in_parallel uses it: `b.o` is up to date (not in the work to do)."""

    def __init__(self, barrier: threading.Barrier | None = None, fail: str = ""):
        self.barrier, self.fail = barrier, fail
        self.compiled: list[tuple] = []

    def _setup_compile(self, output_dir, macros, include_dirs, sources, depends, extra_postargs):
        objects = [s.replace(".c", ".o") for s in sources]
        return macros, objects, ["-post"], ["-Iinc"], {o: (s, ".c") for o, s in zip(objects, sources) if o != "b.o"}

    def _get_cc_args(self, pp_opts, debug, extra_preargs):
        return ["-O3", *pp_opts]

    def _compile(self, obj, src, ext, cc_args, extra_postargs, pp_opts):
        if self.barrier is not None:
            self.barrier.wait()  # both files at once, or a broken barrier
        if src == self.fail:
            raise RuntimeError(f"error compiling {src}")
        self.compiled.append((obj, src, ext, tuple(cc_args), tuple(extra_postargs), tuple(pp_opts)))


def test_the_builds_c_files_compile_side_by_side_and_all_objects_are_returned():
    from gpud.compiled.build import compile_in_parallel

    compiler = _Compiler(threading.Barrier(2, timeout=30))
    objects = compile_in_parallel(compiler, 2, ["a.c", "b.c", "c.c"], macros=[("X", "1")])
    assert objects == ["a.o", "b.o", "c.o"]  # what distutils links: the up-to-date one too
    assert sorted(compiler.compiled) == [("a.o", "a.c", ".c", ("-O3", "-Iinc"), ("-post",), ("-Iinc",)),
                                         ("c.o", "c.c", ".c", ("-O3", "-Iinc"), ("-post",), ("-Iinc",))]


def test_a_c_file_that_fails_fails_the_build():
    from gpud.compiled.build import compile_in_parallel

    with pytest.raises(RuntimeError, match="error compiling c.c"):
        compile_in_parallel(_Compiler(fail="c.c"), 2, ["a.c", "c.c"])


def test_the_builds_type_check_needs_no_checkout(tmp_path):
    """An installed gpud has no pyproject.toml: the build's mypy settings (gpud/compiled/mypy.ini) must pass the
    compiled modules there too (the container image's build failed on missing stubs without them)."""
    import shutil

    pytest.importorskip("mypy")
    shutil.copytree(compiled.PACKAGE_ROOT + "/gpud", tmp_path / "gpud",
                    ignore=shutil.ignore_patterns("lib", "lib.old", "__pycache__", ".build-*"))
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "gpud/compiled/mypy.ini",
                          "--cache-dir", str(tmp_path / ".mypy_cache"),
                          *[os.path.relpath(compiled.source_path(m, str(tmp_path)), tmp_path) for m in compiled.MODULES]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_every_compiled_module_has_its_source():
    for module in compiled.MODULES:
        assert os.path.exists(compiled.source_path(module)), module


def test_no_compiled_function_names_two_exception_types_alike():
    """mypyc types an `except ... as name` once per function: `except A as e` then `except B as e` makes the
    second a TypeError in compiled code (an HTTP handler's exception then went unanswered)."""
    import ast

    clashes = []
    for module in compiled.MODULES:
        path = compiled.source_path(module)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    types.setdefault(node.name, set()).add(ast.unparse(node.type) if node.type else "")
            clashes += [f"{module}:{fn.lineno} {fn.name}: {name} as {sorted(t)}" for name, t in types.items()
                        if len(t) > 1]
    assert clashes == []


# The dataclasses of the compiled modules, each made rarely: at start, per model, per connection, per batch.
MADE_RARELY = {
    "gpud.api.http_server.HttpServer", "gpud.registry.RegisteredVersion", "gpud.registry.RegisteredModel",
    "gpud.executor.batcher.Dispatch", "gpud.executor.batcher.Idle", "gpud.executor.batcher._Config",
    "gpud.executor.stats.Duration", "gpud.executor.stats.BatchStats", "gpud.executor.stats.LatencyHistograms",
    "gpud.executor.stats.ModelStats", "gpud.frontproc.arena._Space", "gpud.frontproc.host.FrontendProcess",
    "gpud.api.grpcwire.calls.Method", "gpud.api.grpcwire.keepalive.Keepalive",
    # per shared-memory tensor (a request in shared memory costs a region lookup and a copy besides)
    "gpud.executor.types.ShmRef", "gpud.executor.types.RegionSlice", "gpud.executor.types.ClientIO",
}


def _writes_own_init(node) -> bool:
    """A dataclass decorated with init=False that defines __init__: compiled, like a plain class's."""
    import ast

    no_init = any(isinstance(d, ast.Call) and "dataclass" in ast.unparse(d.func)
                  and any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                          for k in d.keywords) for d in node.decorator_list)
    return no_init and any(isinstance(b, ast.FunctionDef) and b.name == "__init__" for b in node.body)


def test_compiled_modules_make_no_dataclass_per_request():
    """mypyc compiles a dataclass's fields but not the `__init__` (nor `__eq__`) that the decorator generates: it
    stays interpreted, ~0.4-0.9 µs a call more than a compiled one. Made per request (HttpRequest, QueuedRequest,
    Wait, PreparedRequest, EncodedResponse, the arena's Block) they cost the core's loop ~2.3 µs a request, so those
    are plain classes, or dataclasses with `init=False` and an `__init__` of their own (InferRequest, InferTensor,
    InferResponse: public, they keep repr, == and dataclasses.replace). A new dataclass in a compiled module is fine
    if it is made rarely: add it above."""
    import ast

    found = set()
    for module in compiled.MODULES:
        path = compiled.source_path(module)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    "dataclass" in ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list):
                if _writes_own_init(node):
                    continue
                found.add(f"{module}.{node.name}")
    assert found == MADE_RARELY
