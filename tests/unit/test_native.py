"""app/native.py: compiled twin modules load only while fresh, and give the plain-Python results."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app import native

ROOT = Path(__file__).resolve().parents[2]

# Every mode, every handoff mode, outages and a load that queues: each of the twin's paths runs.
RUN_ALL_MODES = """
import dataclasses, json, sys
from app.config import Mode
from app.config.file import load_config
from app.sim import AgenticWorkload, Outage, simulate
from app.sim.cluster import derive
from app import native

base = load_config("serve_configs/gpu_h100_h200.yaml")
w = AgenticWorkload(requests=1500, rps=8.0, seed=3)
out = {"compiled": native.compiled_modules(), "runs": {}}
for mode in Mode:
    for handoff in (["one_shot", "catch_up", "auto"] if mode is Mode.pdd else ["auto"]):
        config = derive(base, mode=mode)
        config = config.model_copy(update={"handoff": config.handoff.model_copy(update={"mode": handoff})})
        # outages put P-RLD, P-P-MD (and P-RLD-MD's waits on a cut link) in the mix
        outages = [Outage(30, 60, "wan"), Outage(90, 100, "main_decode"), Outage(110, 130, "relay_decode")] if mode is Mode.pdd else []
        run = simulate(config, w, seed=5, outages=outages)
        out["runs"][f"{mode.value}/{handoff}"] = [repr(dataclasses.astuple(r)) for r in run.records()]
json.dump(out, sys.stdout)
"""


def _run_all_modes(compiled: bool) -> dict:
    env = {**os.environ, native.ENV_SWITCH: "1" if compiled else "0"}
    done = subprocess.run([sys.executable, "-c", RUN_ALL_MODES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not native.fresh_builds(), reason="no compiled build: `pdd native build` (make install runs it)")
def test_compiled_twin_gives_the_plain_python_results_in_every_mode():
    compiled, python = _run_all_modes(True), _run_all_modes(False)
    assert compiled["compiled"] == sorted(native.MODULES)
    assert python["compiled"] == []
    assert compiled["runs"].keys() == python["runs"].keys()
    for key, rows in python["runs"].items():
        assert len(rows) == 1500, key
        assert compiled["runs"][key] == rows, key


def _package(tmp_path: Path) -> Path:
    root = tmp_path / "app"
    (root / "sim").mkdir(parents=True)
    (root / "policy.py").write_text("X = 1\n")
    (root / "sim" / "routing.py").write_text("Y = 2\n")
    (root / "sim" / "routing.pxd").write_text("cdef class Z:\n    pass\n")
    return root


def _manifest(tmp_path: Path, root: Path, suffix: str = importlib.machinery.EXTENSION_SUFFIXES[0]) -> Path:
    build = tmp_path / f"_native{suffix}"
    modules = {}
    for module in ("app.policy", "app.sim.routing"):
        file = native.compiled_file(module, suffix)
        (build / file).parent.mkdir(parents=True, exist_ok=True)
        (build / file).write_bytes(b"")
        modules[module] = {"file": str(file), "sha256": native.source_hash(module, root)}
    path = build / "manifest.json"
    path.write_text(json.dumps({"extension_suffix": suffix, "modules": modules}))
    return path


def test_a_module_edited_since_the_build_runs_the_whole_build_as_python(tmp_path):
    """All or none: a compiled module refuses to load beside the plain Python module of a class it declares."""
    root = _package(tmp_path)
    manifest = _manifest(tmp_path, root)
    assert set(native.fresh_builds(manifest, root)) == {"app.policy", "app.sim.routing"}
    source = (root / "policy.py").read_text()
    (root / "policy.py").write_text("X = 2\n")
    assert native.fresh_builds(manifest, root) == {}
    (root / "policy.py").write_text(source)
    assert set(native.fresh_builds(manifest, root)) == {"app.policy", "app.sim.routing"}
    (root / "sim" / "routing.pxd").write_text("cdef class Z:\n    cdef public object w\n")  # declarations count too
    assert native.fresh_builds(manifest, root) == {}


def test_a_build_for_another_python_or_a_missing_file_is_not_loaded(tmp_path):
    root = _package(tmp_path)
    assert native.fresh_builds(_manifest(tmp_path, root, suffix=".cpython-39-x86_64-linux-gnu.so"), root) == {}
    manifest = _manifest(tmp_path, root)
    next(manifest.parent.rglob("policy.*")).unlink()
    assert native.fresh_builds(manifest, root) == {}
    manifest.write_text("{not json")
    assert native.fresh_builds(manifest, root) == {}
    assert native.fresh_builds(tmp_path / "absent.json", root) == {}


def test_every_listed_module_exists_and_has_no_coroutines_or_pydantic_models():
    for module in native.MODULES:
        source = native._source(module).read_text()
        assert "async def" not in source, f"{module}: Cython's coroutines are not asyncio's (keep it Python)"
        assert "BaseModel" not in source, f"{module}: pydantic refuses compiled classes (keep it Python)"


def _assigned_fields(source: str) -> dict[str, set[str]]:
    """Class name -> attributes its methods assign on `self`."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                target.attr
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for root in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                for target in ast.walk(root)
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            }
    return out


def _declared_fields(pxd: str) -> dict[str, set[str]]:
    """Class name -> fields a .pxd declares (`cdef class X(...):` then `cdef public object a, b`)."""
    out: dict[str, set[str]] = {}
    for line in pxd.splitlines():
        if match := re.match(r"cdef class (\w+)", line):
            current = out.setdefault(match.group(1), set())
        elif match := re.match(r"\s+cdef public \w+ (.+)", line):
            current.update(name.strip() for name in match.group(1).split(","))
    return out


def test_each_pxd_declares_exactly_the_fields_its_classes_assign():
    """A compiled class refuses an attribute its .pxd lacks, at run time only: keep them in step."""
    assigned = {}
    for module in native.MODULES:
        assigned.update(_assigned_fields(native._source(module).read_text()))
    declared: dict[str, set[str]] = {}
    for pxd in native._declarations(native.PACKAGE_ROOT):
        declared.update(_declared_fields(pxd.read_text()))
    assert declared, "no .pxd found"
    fields_live_on = {"Twin": "PDDPipelines"}  # Twin's state is declared on its compiled base, for the pipelines' methods
    used: dict[str, set[str]] = {}
    for cls, fields in assigned.items():
        used.setdefault(fields_live_on.get(cls, cls), set()).update(fields)
    for cls, fields in declared.items():
        if cls in fields_live_on:
            assert not fields, f"{cls}: declare its fields on {fields_live_on[cls]}"
            continue
        want = used.get(cls, set())
        assert fields == want, f"{cls}: declared, never assigned {sorted(fields - want)}; assigned, not declared {sorted(want - fields)}"


def test_pdd_native_status_names_each_module_and_how_it_loads(monkeypatch):
    from typer.testing import CliRunner

    from app.ops.cli import main

    builds = native.fresh_builds()
    out = CliRunner().invoke(main, ["native", "status"], terminal_width=200).output
    for module in native.MODULES:
        line = next(line for line in out.splitlines() if line.startswith(module + " "))
        assert ("compiled" if module in builds else "python") in line, line
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    out = CliRunner().invoke(main, ["native", "status"], terminal_width=200).output
    assert out.count(f"python ({native.ENV_SWITCH}=0)") == len(native.MODULES), out
