"""The README's commands as a new user runs them: `bash scripts/lab.sh` (as root in CI and in
containers) reaches a running JupyterLab on the quickstart, and every command the README names exists
in the virtualenv that scripts/setup.sh makes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
# setup.sh leaves this in the virtualenv it installed into; elsewhere lab.sh would install anew.
SETUP_STAMP = VENV / ".oommagic-install"

needs_setup_venv = pytest.mark.skipif(
    not SETUP_STAMP.exists(), reason=f"not the virtualenv scripts/setup.sh made ({VENV}): run scripts/test.sh"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read()


@needs_setup_venv
def test_lab_sh_reaches_a_running_server_on_the_quickstart():
    port, token = free_port(), "lab-sh-test"
    proc = subprocess.Popen(
        [
            "bash",
            "scripts/lab.sh",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
        ],
        cwd=ROOT,
        env={**os.environ, "OOMMAGIC_VENV": str(VENV)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # Read all along, so the server never blocks on a full pipe and the whole log is there to show.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if any("Use Control-C to stop this server" in line for line in lines):
                break
            time.sleep(0.2)
        log = "".join(lines)
        assert proc.poll() is None, f"lab.sh ended ({proc.returncode}):\n{log}"
        assert "Running as root is not recommended" not in log

        if os.geteuid() == 0:
            assert "running as root: passing --allow-root" in log
        else:
            assert "--allow-root" not in log
        # The address it prints, the one to open with --no-browser, is the quickstart's.
        assert re.search(rf"http://\S+:{port}/lab/tree/notebooks/quickstart\.ipynb\?token=", log), log

        # The host the server printed (it may listen on localhost's IPv6 address only), asked again for a
        # few seconds: the line can come out a moment before the socket accepts.
        host = re.search(rf"http://([^/\s]+):{port}/", log).group(1)
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        for _ in range(50):
            try:
                status = get(f"{base}/api/status", token)[0]
                break
            except urllib.error.URLError:
                time.sleep(0.2)
        else:
            status = get(f"{base}/api/status", token)[0]
        assert status == 200, "".join(lines)
        status, body = get(f"{base}/api/contents/notebooks/quickstart.ipynb?content=0", token)
        assert status == 200 and json.loads(body)["type"] == "notebook"
        status, body = get(f"{base}/lab/tree/notebooks/quickstart.ipynb", token)
        assert status == 200 and b"oommagic" in body, "the page's config lists the oommagic extension"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)


@needs_setup_venv
def test_every_command_the_readme_names_is_in_the_venv():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\.venv/bin/([\w.-]+)", readme))
    assert {"ipython", "jupyter"} <= named, "the README shows terminal IPython and JupyterLab from .venv"
    missing = sorted(name for name in named if not os.access(VENV / "bin" / name, os.X_OK))
    assert not missing, f"named in the README, missing from {VENV}/bin: {missing}"


def test_scripts_parse():
    for script in [*sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run"]:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
