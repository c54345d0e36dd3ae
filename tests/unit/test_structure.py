"""The package's shape: no import circles, small modules and classes, roles that do not leak."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = REPO / "tunix_tasks"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> tunix_tasks modules it imports (anywhere in the file, lazy ones too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_circles():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages work.
            if node != dep.rsplit(".", 1)[0] and state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_fmt_skip_in_the_library_and_the_largest_modules_are_reported(capsys):
    """Modules are sized by concept, not to meet a cap: nothing is squeezed onto one
    line to fit one. The largest modules and classes are printed for the reader."""
    squeezed = [
        f"{path.relative_to(REPO)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not squeezed, f"formatter switched off in the library: {squeezed}"
    modules = sorted(
        ((p.read_text().count("\n"), str(p.relative_to(PACKAGE))) for p in PACKAGE.rglob("*.py")),
        reverse=True,
    )
    classes = sorted(
        (node.end_lineno - node.lineno + 1, f"{path.stem}.{node.name}")
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    )[::-1]
    with capsys.disabled():
        print("\nlargest modules:", ", ".join(f"{name} {n}" for n, name in modules[:5]))
        print("largest classes:", ", ".join(f"{name} {n}" for n, name in classes[:5]))


def test_every_folder_map_names_its_modules():
    """Each folder's `__init__` docstring maps its modules and subfolders."""
    missing = []
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        folder = init.parent
        names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        names += [d.name for d in folder.iterdir() if (d / "__init__.py").is_file()]
        missing += [
            f"{folder.relative_to(REPO)}/{n}" for n in names if not re.search(rf"\b{n}\b", doc)
        ]
    assert not missing, f"modules missing from their folder's __init__ map: {missing}"


def test_storage_and_policy_do_not_import_the_roles_above_them():
    """storage/ and policy/ are shared by every role: they import no actor, learner, env."""
    graph = _import_graph()
    for module, deps in graph.items():
        if module.startswith(("tunix_tasks.storage", "tunix_tasks.policy")):
            bad = [
                d
                for d in deps
                if d.startswith(
                    (
                        "tunix_tasks.actor",
                        "tunix_tasks.learner",
                        "tunix_tasks.envs",
                        "tunix_tasks.frontdoor",
                    )
                )
            ]
            assert not bad, f"{module} imports {bad}"


def _imported(path: Path) -> list[str]:
    """Every module name an `import` or `from` statement of `path` names."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_nothing_in_the_library_imports_airflow():
    for path in PACKAGE.rglob("*.py"):
        assert not any(n.split(".")[0] == "airflow" for n in _imported(path)), path


def test_nothing_in_the_library_imports_the_testing_helpers():
    for path in PACKAGE.rglob("*.py"):
        if not path.is_relative_to(PACKAGE / "testing"):
            assert not any(n.startswith("tunix_tasks.testing") for n in _imported(path)), path


def test_public_api_is_small_documented_and_light():
    import tunix_tasks

    script = "import sys, tunix_tasks; print(any(m.startswith('jax') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", "import tunix_tasks must not import JAX"
    assert len(tunix_tasks.__all__) <= 25
    for name in tunix_tasks.__all__:
        assert getattr(tunix_tasks, name).__doc__, name
    for sub in ("actor", "storage", "learner", "policy", "frontdoor", "envs"):
        assert (PACKAGE / sub / "__init__.py").read_text().startswith('"""'), sub
