"""The compiled request path (gpud.compiled): used only while it matches the sources, never a stale build."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpud import compiled

TAG = sys.implementation.cache_tag


def manifest(hashes: dict[str, str], tag: str = TAG) -> dict:
    return {"cache_tag": tag, "modules": {m: {"so": f"{m}.so", "sha256": h} for m, h in hashes.items()},
            "libraries": {}}


HASHES = {m: f"hash-{i}" for i, m in enumerate(compiled.MODULES)}


def test_a_build_that_matches_every_source_is_used():
    status = compiled.decide(manifest(HASHES), HASHES, TAG, pure=False)
    assert status.compiled and "compiled (mypyc)" in status.reason


def test_one_changed_source_makes_the_whole_set_pure_python_and_says_which():
    now = dict(HASHES, **{"gpud.executor.batcher": "edited"})
    status = compiled.decide(manifest(HASHES), now, TAG, pure=False)
    assert not status.compiled
    assert "gpud.executor.batcher changed since the build" in status.reason
    assert "python -m gpud.compiled.build" in status.reason


def test_several_changed_sources_are_counted():
    now = {m: "edited" for m in HASHES}
    status = compiled.decide(manifest(HASHES), now, TAG, pure=False)
    assert not status.compiled and f"and {len(HASHES) - 1} more" in status.reason


def test_no_build_another_python_another_module_set_and_the_switch_are_pure_python():
    assert "no compiled build" in compiled.decide(None, HASHES, TAG, pure=False).reason
    other = compiled.decide(manifest(HASHES, tag="cpython-399"), HASHES, TAG, pure=False)
    assert not other.compiled and "cpython-399" in other.reason
    fewer = dict(list(HASHES.items())[1:])
    assert not compiled.decide(manifest(fewer), HASHES, TAG, pure=False).compiled
    assert not compiled.decide(manifest(HASHES), {m: None for m in HASHES}, TAG, pure=False).compiled
    pure = compiled.decide(manifest(HASHES), HASHES, TAG, pure=True)
    assert not pure.compiled and compiled.PURE_ENV in pure.reason


def test_a_missing_or_unreadable_manifest_reads_as_none(tmp_path):
    assert compiled.read_manifest(str(tmp_path)) is None
    (tmp_path / compiled.MANIFEST).write_text("{not json")
    assert compiled.read_manifest(str(tmp_path)) is None
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest(HASHES)))
    assert compiled.read_manifest(str(tmp_path)) == manifest(HASHES)


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

    hashes = {m: compiled.source_hash(compiled.source_path(m)) for m in compiled.MODULES}
    monkeypatch.setattr(compiled, "read_manifest", lambda lib_dir=compiled.LIB_DIR: manifest(hashes))
    monkeypatch.setattr(build, "build", lambda **kw: pytest.fail("must not build"))
    assert build.main(["--if-stale"]) == 0
    assert "matches the sources" in capsys.readouterr().out


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
