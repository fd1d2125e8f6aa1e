"""The import graph: agents/ sits on app/, app/'s packages are layers that import only downward,
app/telemetry/ sits under both app/ and agents/, and no module imports itself back. And every
module stays a size a newcomer reads in one sitting: 400 lines, 80 per function.

Every import statement of every module under app/ and agents/ counts, those
inside functions and under TYPE_CHECKING too: a lazy or typing-only import is
still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "agents")
#: What app/telemetry/ may import from the rest of the project.
TELEMETRY_MAY_IMPORT = {"app.config"}
#: app/'s layers, lowest first; a module imports only from its own layer or those below.
LAYERS = (
    ("app.config", "app.ray_private"),
    ("app.policy", "app.telemetry"),
    ("app.engine",),
    ("app.conductor",),
    ("app.api",),
    ("app.builder",),
    ("app.ops", "app.sim", "app.native", "app"),
)


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_native" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `module` imports (a name imported from a package counts as its submodule when it is one)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {known(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".rstrip(".")
            found |= {known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base) for alias in node.names}
    return {m for m in found if m and m != module}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def test_the_graph_is_read():
    graph = import_graph()
    assert {"app.conductor.conductor", "app.telemetry.queries", "agents.graph", "agents.chatops.rules"} <= graph.keys()
    assert "app.conductor.relay" in graph["app.conductor.conductor"] and "app.telemetry.snapshot" in graph["agents.diagnose"]
    assert "app.conductor.link_directory" in graph["app.conductor.engine_ops"]  # the TYPE_CHECKING import counts


def test_app_imports_nothing_from_agents():
    upward = {(m, d) for m, deps in import_graph().items() if m.startswith("app") for d in deps if d.startswith("agents")}
    assert not upward, f"app/ imports agents/ (add an extension point in app/api/extensions.py instead): {sorted(upward)}"


def layer_of(module: str) -> int:
    """The layer of the longest LAYERS prefix that names `module` or a package above it."""
    matches = [(len(name), i) for i, names in enumerate(LAYERS) for name in names if module == name or module.startswith(name + ".")]
    return max(matches)[1]


def test_app_imports_only_downward():
    upward = {(m, d) for m, deps in import_graph().items() if m.startswith("app") for d in deps if d.startswith("app") and layer_of(d) > layer_of(m)}
    assert not upward, f"an upward import in app/ (LAYERS lists the order): {sorted(upward)}"


def test_telemetry_sits_under_the_rest_of_the_app():
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if m.startswith("app.telemetry")
        for d in deps
        if not d.startswith("app.telemetry") and d not in TELEMETRY_MAY_IMPORT
    }
    assert not wrong, sorted(wrong)


def test_no_import_cycle():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_small():
    too_long = []
    for module, path in project_modules().items():
        source = path.read_text()
        if (lines := source.count("\n")) > MAX_MODULE_LINES:
            too_long.append(f"{module}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, too_long
