"""Compiled builds of the digital twin's hot modules: the same Python sources, compiled by Cython.

The twin runs the conductor's own routing and policy code on every simulated
request, so its speed is that of the Python it shares with the real app.
`pdd native build` (run by `make install`) compiles `MODULES`, the
.py files unchanged plus the .pxd beside a module where one declares its
classes' fields, into `app/_native/` with a manifest of the hash of each
module's sources. `install()` (called from `app/__init__`) puts a finder in
front of the import system that loads the compiled modules only while all their
sources hash as they did at build time: after an edit, the twin runs as plain
Python until the next build, never as stale code. All or none, as the compiled
modules take each other's classes as C types (a compiled module refuses to load
beside the plain Python one of a class it declares). Without a build, with a
different Python, or with PDD_NATIVE=0, everything runs as plain Python; the
results are the same either way (tests/unit/test_native.py runs the twin both ways and compares).

Modules with coroutines stay Python (asyncio and FastAPI tell coroutine functions
apart by type, which Cython's are not), and so do pydantic models (pydantic
takes a compiled method for a field without annotation).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
"""The `app` package's directory."""
BUILD_DIR = PACKAGE_ROOT / "_native"
MANIFEST = BUILD_DIR / "manifest.json"
ENV_SWITCH = "PDD_NATIVE"
"""Set to 0 to run every module as plain Python."""

MODULES = (
    "app.policy",
    "app.conductor.prefix_index",
    "app.sim.baselines",
    "app.sim.cache",
    "app.sim.cluster",
    "app.sim.engine",
    "app.sim.events",
    "app.sim.jobs",
    "app.sim.network",
    "app.sim.outages",
    "app.sim.pdd",
    "app.sim.pending",
    "app.sim.perf",
    "app.sim.results",
    "app.sim.routing",
    "app.sim.twin",
    "app.sim.work",
)
"""What the twin runs per event: its own modules, and the conductor's routing index and policy."""

COMPILER_DIRECTIVES = {
    "language_level": 3,
    # annotations stay documentation: `x: float` must not turn into a C double that refuses None
    "annotation_typing": False,
    "binding": True,
}


def _source(module: str, root: Path = PACKAGE_ROOT) -> Path:
    return root.joinpath(*module.split(".")[1:]).with_suffix(".py")


def compiled_file(module: str, suffix: str = importlib.machinery.EXTENSION_SUFFIXES[0]) -> Path:
    """Where a module's compiled file lies in a build directory."""
    return Path(*module.split(".")).with_name(module.rsplit(".", 1)[1] + suffix)


def _declarations(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.pxd") if BUILD_DIR.name not in p.relative_to(root).parts)


def source_hash(module: str, root: Path = PACKAGE_ROOT, declarations: list[Path] | None = None) -> str:
    """Of the module's .py file and every .pxd under `root` (one module's declarations can
    cimport another's, so a change to any of them rebuilds them all)."""
    digest = hashlib.sha256()
    for path in [_source(module, root), *(_declarations(root) if declarations is None else declarations)]:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fresh_builds(manifest_path: Path = MANIFEST, root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Module name -> compiled file, for every compiled module of the build when each
    one's sources are unchanged since then and its file fits this Python; else empty."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return {}
    if manifest.get("extension_suffix") != importlib.machinery.EXTENSION_SUFFIXES[0]:
        return {}
    out = {}
    declarations = _declarations(root)
    for module, entry in manifest.get("modules", {}).items():
        try:
            path = manifest_path.parent / entry["file"]
            if not (path.exists() and entry["sha256"] == source_hash(module, root, declarations)):
                return {}
            out[module] = path
        except (OSError, KeyError, TypeError):
            return {}
    return out


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the fresh compiled modules; every other import goes on as usual."""

    def __init__(self, builds: dict[str, Path]):
        self.builds = builds

    def find_spec(self, fullname, path=None, target=None):
        so = self.builds.get(fullname)
        if so is None:
            return None
        return importlib.util.spec_from_file_location(fullname, so, loader=importlib.machinery.ExtensionFileLoader(fullname, str(so)))


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def install() -> CompiledFinder | None:
    if not enabled() or any(isinstance(f, CompiledFinder) for f in sys.meta_path):
        return None
    builds = fresh_builds()
    if not builds:
        return None
    finder = CompiledFinder(builds)
    sys.meta_path.insert(0, finder)
    return finder


def compiled_modules() -> list[str]:
    """The modules this process has loaded compiled."""
    return sorted(
        name
        for name, mod in sys.modules.items()
        if name in MODULES and str(getattr(mod, "__file__", "")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    )


def build(out: Path = BUILD_DIR) -> dict:
    """Compile MODULES into `out` and write its manifest; returns the manifest."""
    import Cython  # build-time only
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    root = PACKAGE_ROOT.parent
    started = time.perf_counter()
    print(f"compiling {len(MODULES)} modules with Cython into {out} (about a minute on 2 cores) ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="pdd-native-") as tmp:
        extensions = [Extension(m, [str(_source(m).relative_to(root))]) for m in MODULES]
        cwd = os.getcwd()
        os.chdir(root)  # module names follow the paths cythonize is given
        try:
            compiled = cythonize(extensions, compiler_directives=COMPILER_DIRECTIVES, build_dir=tmp, quiet=True, nthreads=os.cpu_count() or 1)
            cmd = Distribution({"ext_modules": compiled}).get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp, cmd.parallel = str(out), str(Path(tmp) / "obj"), os.cpu_count() or 1
            cmd.ensure_finalized()
            cmd.run()
        finally:
            os.chdir(cwd)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    declarations = _declarations(PACKAGE_ROOT)
    modules = {}
    for m in MODULES:
        file = compiled_file(m, suffix)
        if not (out / file).exists():
            raise RuntimeError(f"the build left no {out / file} for {m}")
        modules[m] = {"file": str(file), "sha256": source_hash(m, PACKAGE_ROOT, declarations)}
    manifest = {"extension_suffix": suffix, "cython": Cython.__version__, "modules": modules}
    (out / MANIFEST.name).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"compiled {len(modules)} modules in {time.perf_counter() - started:.0f} s", flush=True)
    return manifest
