"""The kernel routes on a real Jupyter server with a real kernel: ``GET oommagic/kernels`` maps a kernel's
process to its notebook, ``POST oommagic/kernels/shutdown`` shuts down only this server's kernels, only
with a token and a confirmation."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"oommagic": True}}}


async def shutdown(jp_fetch, body: dict, **kw):
    return await jp_fetch(
        "oommagic", "kernels", "shutdown", method="POST", body=json.dumps(body), raise_error=False, **kw
    )


async def kernels(jp_fetch) -> list[dict]:
    response = await jp_fetch("oommagic", "kernels")
    assert response.code == 200
    data = json.loads(response.body)
    assert data["version"] == 1
    return data["kernels"]


async def start_kernel(jp_fetch) -> str:
    """A real kernel started for the notebook other.ipynb through the server's sessions API (the server
    shuts it down at the end of the test)."""
    body = {"path": "other.ipynb", "type": "notebook", "name": "other.ipynb", "kernel": {"name": "python3"}}
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
    return json.loads(response.body)["kernel"]["id"]


async def test_a_kernel_is_listed_with_its_pid_and_notebook(jp_fetch):
    notebook_kernel = await start_kernel(jp_fetch)
    listed = {k["kernel_id"]: k for k in await kernels(jp_fetch)}
    mine = listed[notebook_kernel]
    assert mine["notebook"] == "other.ipynb" and mine["name"] == "python3"
    assert isinstance(mine["pid"], int) and os.path.exists(f"/proc/{mine['pid']}")


async def test_shutdown_of_one_of_its_kernels_with_confirmation(jp_fetch):
    notebook_kernel = await start_kernel(jp_fetch)
    pid = {k["kernel_id"]: k for k in await kernels(jp_fetch)}[notebook_kernel]["pid"]
    unconfirmed = await shutdown(jp_fetch, {"pid": pid})
    assert unconfirmed.code == 400
    assert notebook_kernel in {k["kernel_id"] for k in await kernels(jp_fetch)}
    response = await shutdown(jp_fetch, {"pid": pid, "confirm": True})
    assert response.code == 200
    assert json.loads(response.body) == {"shut_down": notebook_kernel, "pid": pid, "notebook": "other.ipynb"}
    assert notebook_kernel not in {k["kernel_id"] for k in await kernels(jp_fetch)}
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail(f"kernel process {pid} still runs")


async def test_a_pid_that_is_not_one_of_its_kernels_is_refused(jp_fetch):
    notebook_kernel = await start_kernel(jp_fetch)
    # The server's own process, and this test's parent: real processes, not kernels of this server.
    for pid in (os.getpid(), os.getppid()):
        response = await shutdown(jp_fetch, {"pid": pid, "confirm": True})
        assert response.code == 404
        assert b"not a kernel of this server" in response.body
    assert notebook_kernel in {k["kernel_id"] for k in await kernels(jp_fetch)}


@pytest.mark.parametrize("authorization", ["", "token not-the-token"])
async def test_shutdown_without_a_valid_token_is_refused(jp_fetch, authorization):
    notebook_kernel = await start_kernel(jp_fetch)
    pid = {k["kernel_id"]: k for k in await kernels(jp_fetch)}[notebook_kernel]["pid"]
    response = await shutdown(
        jp_fetch,
        {"pid": pid, "confirm": True},
        headers={"Authorization": authorization},
        follow_redirects=False,
    )
    assert response.code in (302, 401, 403)
    assert notebook_kernel in {k["kernel_id"] for k in await kernels(jp_fetch)}


async def test_a_malformed_request_is_refused(jp_fetch):
    for body in ({}, {"pid": "12"}, {"pid": 1.5, "confirm": True}):
        assert (await shutdown(jp_fetch, body)).code == 400


async def test_a_body_nested_too_deeply_is_refused_as_malformed(jp_fetch):
    async def post(body: str):
        return await jp_fetch("oommagic", "kernels", "shutdown", method="POST", body=body, raise_error=False)

    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"pid": ' + deep + ', "confirm": true}'):
        response = await post(body)
        assert response.code == 400, response.body[:300]
        assert b"nested too deeply" in response.body
