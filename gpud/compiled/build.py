"""Compile gpud's request path with mypyc into gpud/compiled/lib/ (see gpud.compiled).

    python -m gpud.compiled.build [--if-stale] [--quiet]

Needs mypy (the `compile` extra: `pip install 'gpud[compile]'`; the `test` extra has it too), a C compiler and
Python's headers. Takes one to two minutes on two cores (its C files compile side by side). Without them it says why
and exits 1; gpud then runs as pure Python, the same behaviour at more CPU per request. `--if-stale`: do nothing
when the build matches the sources.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpud import compiled


def _missing() -> str | None:
    """What the build needs and this machine lacks, or None."""
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypy (with mypyc) is not installed: pip install 'gpud[compile]'"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"Python's headers (Python.h) are not in {include}: install python3-dev or its equivalent"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) on PATH: install gcc or clang"
    return None


def _parallel_build_ext(jobs: int) -> type:
    """setuptools' build_ext whose compiler compiles an extension's C files `jobs` at a time (distutils compiles
    them one after another; its `--parallel` is per extension, and mypyc makes one of all the modules)."""
    from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]

    class ParallelBuildExt(build_ext):
        def build_extension(self, ext: Any) -> None:
            compiler = self.compiler
            if all(hasattr(compiler, name) for name in ("_setup_compile", "_get_cc_args", "_compile")):
                compiler.compile = functools.partial(compile_in_parallel, compiler, jobs)
            super().build_extension(ext)

    return ParallelBuildExt


def compile_in_parallel(compiler: Any, jobs: int, sources: list[str], output_dir: str | None = None,
                        macros: Any = None, include_dirs: Any = None, debug: bool = False, extra_preargs: Any = None,
                        extra_postargs: Any = None, depends: Any = None) -> list[str]:
    """distutils' `CCompiler.compile` with its loop over the files run by `jobs` threads (the compiler runs as
    processes of its own). A file that fails fails the build, as in the loop."""
    macros, objects, extra_postargs, pp_opts, todo = compiler._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

    def one(obj: str) -> None:
        src, ext = todo[obj]
        compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for _ in pool.map(one, [obj for obj in objects if obj in todo]):  # re-raises the first failure
            pass
    return objects  # all of them, as distutils returns, not only those compiled now


def build(lib_dir: str = compiled.LIB_DIR, quiet: bool = False) -> None:
    """Compile compiled.MODULES into `lib_dir` (replacing what is there, only once the new build is complete)."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    root = compiled.PACKAGE_ROOT
    hashes = compiled.source_hashes(root)  # before compiling: an edit made meanwhile makes the build stale
    suffix = compiled.EXT_SUFFIX
    # Beside lib/ (the same file system): the finished build replaces the old one with a rename, never a copy that
    # a process starting meanwhile could find half written.
    parent = os.path.dirname(lib_dir)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".build-", dir=parent)
    out = os.path.join(work, "lib")
    cwd = os.getcwd()
    try:
        # From a copy of the sources: mypy names the modules from the directory that holds gpud/, and an installed
        # gpud's is site-packages, whose other modules mypy would then take for ours (mypy_extensions.py "shadows
        # library module").
        src = os.path.join(work, "src")
        shutil.copytree(os.path.join(root, "gpud"), os.path.join(src, "gpud"),
                        ignore=shutil.ignore_patterns("lib", "lib.old", ".build-*", "__pycache__", "*.so"))
        os.chdir(src)
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
                # Our own mypy settings, the same in a checkout and in an installed copy (no pyproject.toml there).
                options = ["--config-file", os.path.join(os.path.dirname(compiled.__file__), "mypy.ini")]
                # One C file per module (multi_file), compiled side by side (_parallel_build_ext): one file of all
                # of them took one core ~2 minutes whatever the machine.
                jobs = os.cpu_count() or 1
                extensions = mypycify(options + [os.path.relpath(compiled.source_path(m, src), src)
                                                 for m in compiled.MODULES],
                                      target_dir=os.path.join(work, "c"), opt_level="3", strip_asserts=False,
                                      multi_file=True)
                dist = Distribution({"name": "gpud-compiled", "ext_modules": extensions,
                                     "cmdclass": {"build_ext": _parallel_build_ext(jobs)}})
                dist.script_args = ["build_ext", "--build-lib", out, "--build-temp", os.path.join(work, "obj"),
                                    "--parallel", str(jobs)]
                if quiet:
                    dist.script_args.insert(0, "--quiet")
                dist.parse_command_line()
                dist.run_commands()
        except BaseException:
            sys.stderr.write(sink.getvalue()[-4000:])  # what mypy or the compiler said, kept back by --quiet
            raise
        modules = {}
        for m in compiled.MODULES:
            so = os.path.join(*m.split(".")) + suffix
            if not os.path.exists(os.path.join(out, so)):
                raise RuntimeError(f"mypyc made no {so}")
            modules[m] = {"so": so}
        libraries = {name[:-len(suffix)]: name for name in os.listdir(out)
                     if name.endswith(suffix) and "__mypyc" in name}
        manifest = {"ext_suffix": suffix, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "modules": modules, "libraries": libraries, "sources": hashes}
        with open(os.path.join(out, compiled.MANIFEST), "w") as f:  # last: a build without it is no build
            json.dump(manifest, f, indent=1)
        # A process that has the old build loaded keeps its mapped files (removed, not overwritten).
        old = lib_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(lib_dir):
            os.rename(lib_dir, old)
        os.rename(out, lib_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpud.compiled.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--if-stale", action="store_true", help="do nothing when the build matches the sources")
    p.add_argument("--quiet", action="store_true", help="print only the outcome")
    args = p.parse_args(argv)
    if args.if_stale and compiled.check()[0].compiled:
        if not args.quiet:
            print("gpud.compiled: the build matches the sources")
        return 0
    missing = _missing()
    if missing:
        print(f"gpud.compiled: not built, gpud runs as pure Python: {missing}", file=sys.stderr)
        return 1
    started = time.monotonic()
    print(f"gpud.compiled: compiling the request path ({len(compiled.MODULES)} modules, one to two minutes on two "
          f"cores; {compiled.PURE_ENV}=1 skips it)", file=sys.stderr, flush=True)
    try:
        build(quiet=args.quiet)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure (mypy exits on a type error) leaves pure Python
        print(f"gpud.compiled: the build failed, gpud runs as pure Python: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"gpud.compiled: {len(compiled.MODULES)} modules compiled into {compiled.LIB_DIR} "
          f"in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
