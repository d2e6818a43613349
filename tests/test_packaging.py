"""What the wheel installs and which way gpud's packages import each other (issue 22, item 0; DESIGN.md's rooms).

gpud installs one top-level import package, `gpud`: as top-level names `placement`, `executor` and `telemetry`
collided with PyPI distributions of the same names (pip overwrote the other's files without a word)."""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpud"


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the test environment has setuptools (the [test] extra), and CI must not need the network here.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, timeout=240, capture_output=True)
    (wheel,) = out.glob("gpud-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_the_wheel_installs_no_top_level_package_but_gpud(wheel_names):
    top = {name.split("/", 1)[0] for name in wheel_names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"gpud"}


def test_the_wheel_carries_the_packages_and_their_data(wheel_names):
    for path in ("gpud/placement/solver.py", "gpud/executor/worker.py", "gpud/telemetry/nvml.py",
                 "gpud/telemetry/nodes/dgx-a100-2gpu-mig.yaml", "gpud/proto/grpc_service.proto"):
        assert path in wheel_names, path


def test_the_wheel_carries_the_compile_step_and_no_build_of_this_tree(wheel_names):
    """`python -m gpud.compiled.build` compiles an installed gpud; a build made in a checkout stays there."""
    assert "gpud/compiled/build.py" in wheel_names
    assert not [n for n in wheel_names if "/compiled/lib" in n or n.endswith(".so")]


def test_the_container_image_copies_only_what_exists():
    """The Containerfile once copied the pre-issue-22 top-level packages, gone from the tree: no image could build."""
    containerfile = ROOT / "deploy" / "container" / "Containerfile"
    for line in containerfile.read_text().splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), f"{containerfile.name}: {line}"


def _gpud_imports(path: Path) -> set[str]:
    """The gpud packages a module imports, by second name ('placement' for gpud.placement.model), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] in ("placement", "executor", "telemetry"):
                found.add("top-level " + parts[0])  # the old names must not come back
            if parts[0] == "gpud" and len(parts) > 1:
                found.add(parts[1])
    return found


# Each room and the gpud packages it may import (DESIGN.md: placement uses none; telemetry and executor never
# import the daemon's wiring).
ALLOWED = {
    "placement": {"placement"},
    "executor": {"executor"},
    "telemetry": {"telemetry", "placement", "executor"},
    "scaling": {"scaling", "telemetry", "placement", "executor"},
}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_imports_point_one_way(room):
    bad = {}
    for path in sorted((PACKAGE / room).rglob("*.py")):
        extra = _gpud_imports(path) - ALLOWED[room]
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert bad == {}


def test_nothing_imports_the_old_top_level_names():
    bad = [str(p.relative_to(ROOT)) for d in ("gpud", "tests", "bench", "scripts") for p in (ROOT / d).rglob("*.py")
           if any(n.startswith("top-level ") for n in _gpud_imports(p))]
    assert bad == []


def _module_graph() -> dict[str, set[str]]:
    """gpud's modules and the gpud modules each imports: every import statement, also those under TYPE_CHECKING and
    inside functions (a circle hidden there is still a circle)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        if "proto" in path.relative_to(PACKAGE).parts[:1]:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module pkg.mod (and runs pkg's __init__, which is not a circle)
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("gpud.") else None
                if target is not None and target != module and target != "gpud":
                    graph[module].add(target)
    return graph


def test_no_import_circles_in_gpud():
    graph = _module_graph()
    assert len(graph) > 100  # the walk found the package
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "proto" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpud"):
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []
