"""Packaging: one version for the Python package and the lab extension, the wheel check that CI runs
on the release build (scripts/check_wheel.py) tells a production build from a development one, and the
stored notebooks are what JupyterLab would save on open (scripts/clean_notebooks.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import zipfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_wheel = load_script("check_wheel")
clean_notebooks = load_script("clean_notebooks")

DATA = f"oommagic-{VERSION}.data/data/"
LABEXT = DATA + "share/jupyter/labextensions/oommagic/"
PRODUCTION = {
    "oommagic/__init__.py": "",
    f"oommagic-{VERSION}.dist-info/METADATA": f"Metadata-Version: 2.4\nName: oommagic\nVersion: {VERSION}\n",
    DATA + "etc/jupyter/jupyter_server_config.d/oommagic.json": json.dumps(
        {"ServerApp": {"jpserver_extensions": {"oommagic": True}}}
    ),
    LABEXT + "package.json": json.dumps(
        {
            "name": "oommagic",
            "version": VERSION,
            "jupyterlab": {"_build": {"load": "static/remoteEntry.ab12.js"}},
        }
    ),
    LABEXT + "install.json": json.dumps({"packageManager": "python", "packageName": "oommagic"}),
    LABEXT + "static/remoteEntry.ab12.js": 'var _JUPYTERLAB;(()=>{"use strict";var e={}})();',
    LABEXT + "static/style.js": 'import "./style_index.css";',
}


def wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / f"oommagic-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_the_python_package_has_the_lab_extensions_version():
    assert importlib.metadata.version("oommagic") == VERSION


def test_wheel_check_passes_a_production_build(tmp_path):
    assert check_wheel.problems(wheel(tmp_path, PRODUCTION)) == []


def test_wheel_check_rejects_what_a_development_install_leaves(tmp_path):
    development = {
        **PRODUCTION,
        LABEXT + "build_log.json": json.dumps({"context": "/work/oommagic/labextension"}),
        LABEXT + "static/remoteEntry.ab12.js": '/***/ "./lib/index.js":\n/*!**********!*\\\n',
        LABEXT + "static/remoteEntry.ab12.js.map": "{}",
    }
    found = "\n".join(check_wheel.problems(wheel(tmp_path, development)))
    assert "build_log.json" in found
    assert "source maps without being asked for" in found
    assert "development output" in found
    assert "absolute path" in found
    assert check_wheel.problems(wheel(tmp_path, development), source_maps=True) != []


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({LABEXT + "install.json": None}, "missing"),
        ({LABEXT + "install.json": json.dumps({"packageManager": "conda"})}, "install.json does not name"),
        ({LABEXT + "static/remoteEntry.ab12.js": None}, "was not built"),
        ({LABEXT + "package.json": json.dumps({"version": VERSION, "jupyterlab": {}})}, "not a built"),
        ({"oommagic/server.py": "ROOT = '/home/builder/oommagic'"}, "holds the build directory"),
    ],
)
def test_wheel_check_names_what_is_wrong(tmp_path, change, complaint):
    files = {**PRODUCTION, **change}
    files = {name: text for name, text in files.items() if text is not None}
    found = check_wheel.problems(wheel(tmp_path, files), build_dir="/home/builder/oommagic")
    assert any(complaint in problem for problem in found), found


def test_stored_notebooks_are_saved_as_jupyterlab_would_on_open():
    metadata = clean_notebooks.kernel_metadata()
    stale = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        stored = path.read_text()
        nb = nbformat.reads(stored, as_version=4)
        assert not any(c.get("outputs") or c.get("execution_count") for c in nb.cells), (
            f"{path.name}: outputs"
        )
        # language_info.version is the Python of whoever stored it (CI's): compared in the browser test.
        here = json.loads(json.dumps(metadata))
        here["language_info"]["version"] = nb.metadata.get("language_info", {}).get("version")
        if nbformat.writes(clean_notebooks.cleaned(nb, here)) + "\n" != stored:
            stale.append(path.name)
    assert not stale, f"run: .venv/bin/python scripts/clean_notebooks.py   (stale: {stale})"
