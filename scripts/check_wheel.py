"""Check a built oommagic wheel: the lab extension is the production build, ``install.json`` names pip,
no absolute path of the build machine is inside, and the version is labextension/package.json's.

Usage: python scripts/check_wheel.py WHEEL [--build-dir DIR] [--source-maps]

Prints the wheel's size and file list, then each failed check; exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEXT = "share/jupyter/labextensions/oommagic/"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/oommagic.json"
# Where build machines keep their files; none of them belongs in a wheel.
ABSOLUTE_PATH = re.compile(r"(?<![\w.])(/root/|/home/\w|/tmp/|/work/|/Users/\w|[A-Z]:\\\\Users)")
# webpack's development output marks every module like this; the production build has none.
DEV_MODULE_MARK = "/***/"


def problems(wheel: Path, build_dir: str | None = None, source_maps: bool = False) -> list[str]:
    """What is wrong with the wheel (empty when it is fit to publish)."""
    found: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        data = next((n.split("/", 1)[0] + "/data/" for n in names if ".data/data/" in n), None)
        if data is None:
            return ["no data files: the lab extension and the server config are missing"]
        labext = data + LABEXT
        ext_files = [n for n in names if n.startswith(labext)]

        def need(path: str) -> str | None:
            if path not in names:
                found.append(f"missing {path}")
                return None
            return zf.read(path).decode()

        package = need(labext + "package.json")
        if package is not None:
            meta = json.loads(package)
            if "_build" not in meta.get("jupyterlab", {}):
                found.append("the extension's package.json has no jupyterlab._build: not a built extension")
            want = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
            if meta.get("version") != want:
                found.append(f"the extension is version {meta.get('version')}, package.json says {want}")
        install = need(labext + "install.json")
        if install is not None:
            info = json.loads(install)
            if (info.get("packageManager"), info.get("packageName")) != ("python", "oommagic"):
                found.append(f"install.json does not name pip's oommagic: {info}")
        if need(data + SERVER_CONFIG) is not None:
            enabled = json.loads(zf.read(data + SERVER_CONFIG))["ServerApp"]["jpserver_extensions"]
            if enabled.get("oommagic") is not True:
                found.append(f"{SERVER_CONFIG} does not enable the server extension")
        if not any(re.search(r"/static/remoteEntry\.[0-9a-f]+\.js$", n) for n in ext_files):
            found.append("no static/remoteEntry.<hash>.js: the extension was not built")
        if labext + "build_log.json" in names:
            found.append("build_log.json is there: a development build (it holds the build machine's paths)")
        maps = [n for n in ext_files if n.endswith(".map")]
        if maps and not source_maps:
            found.append(f"source maps without being asked for: {maps}")

        version = Parser().parsestr(
            zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )["Version"]
        want = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
        if version != want:
            found.append(f"the wheel is version {version}, labextension/package.json says {want}")
        if not any(n == "oommagic/__init__.py" for n in names):
            found.append("oommagic/__init__.py is missing")
        stray = [n for n in names if "__pycache__" in n or n.startswith(("tests/", "oommagic/labextension/"))]
        if stray:
            found.append(f"files that belong elsewhere: {stray}")

        for name in names:
            try:
                text = zf.read(name).decode()
            except UnicodeDecodeError:
                continue
            if build_dir and build_dir in text:
                found.append(f"{name} holds the build directory {build_dir}")
            elif name.startswith(labext) and (match := ABSOLUTE_PATH.search(text)):
                context = text[max(0, match.start() - 40) : match.end() + 40]
                found.append(f"{name} holds an absolute path: ...{context}...")
            if name.startswith(labext) and name.endswith(".js") and DEV_MODULE_MARK in text:
                found.append(f"{name} is webpack's development output, not the production build")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--build-dir", help="the directory the wheel was built in; it must appear nowhere")
    parser.add_argument("--source-maps", action="store_true", help="source maps were asked for")
    args = parser.parse_args()
    with zipfile.ZipFile(args.wheel) as zf:
        infos = zf.infolist()
    print(f"{args.wheel.name}: {args.wheel.stat().st_size:,} bytes, {len(infos)} files")
    for info in infos:
        print(f"  {info.file_size:>9,}  {info.filename}")
    found = problems(args.wheel, args.build_dir, args.source_maps)
    for problem in found:
        print(f"check_wheel: {problem}", file=sys.stderr)
    if not found:
        print("check_wheel: production build, install.json, no absolute paths, version", "ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
