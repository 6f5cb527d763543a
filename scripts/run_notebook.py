"""Execute a notebook through a real kernel (nbclient) and print what each cell showed as text.

Usage: python scripts/run_notebook.py NOTEBOOK [OUT.ipynb]
"""

from __future__ import annotations

import sys

import nbformat
from nbclient import NotebookClient


def main() -> int:
    path = sys.argv[1]
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=True).execute()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        print(f"\n>>> {cell.source.splitlines()[0] if cell.source else ''}")
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                print(out.text, end="")
            elif out.output_type == "error":
                print(f"{out.ename}: {out.evalue}")
            elif "text/plain" in out.get("data", {}):
                print(out.data["text/plain"])
    if len(sys.argv) > 2:
        nbformat.write(nb, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
