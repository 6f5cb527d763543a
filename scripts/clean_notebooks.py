"""Store the notebooks under notebooks/ the way JupyterLab would save them on open: no outputs, no
execution counts, and the kernelspec and ``language_info`` of the ``python3`` kernel, so that opening one
does not mark it changed.

Usage: python scripts/clean_notebooks.py [--check] [NOTEBOOK ...]   (default: every notebooks/*.ipynb)

The metadata is read from a real kernel of this environment: JupyterLab replaces ``language_info`` with
the kernel's on open, Python version included, so run this with the Python the project targets (CI's).
``--check`` changes nothing and exits 1 naming each notebook that differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def kernel_metadata(kernel_name: str = "python3") -> dict:
    """The notebook metadata JupyterLab writes for `kernel_name`: its kernelspec and language_info.

    Starts the kernel once to ask it.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import start_new_kernel

    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    manager, client = start_new_kernel(kernel_name=kernel_name)
    try:
        info = client.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return {
        "kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": kernel_name},
        "language_info": info,
    }


def cleaned(nb: nbformat.NotebookNode, metadata: dict) -> nbformat.NotebookNode:
    """`nb` without outputs or execution counts and with `metadata` in its notebook metadata."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    nb.metadata.update(nbformat.from_dict(metadata))
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook differs")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    metadata = kernel_metadata()
    differ = []
    for path in paths:
        stored = path.read_text()
        nb = cleaned(nbformat.reads(stored, as_version=4), metadata)
        text = nbformat.writes(nb) + "\n"
        if text != stored:
            differ.append(path)
            if not args.check:
                path.write_text(text)
    verb = "differ from" if args.check else "rewritten as"
    for path in differ:
        print(f"{path}: {verb} a clean notebook for {metadata['kernelspec']['display_name']}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
