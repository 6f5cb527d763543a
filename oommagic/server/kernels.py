"""Routes that map GPU processes to this server's kernels and shut one down on request.

``GET <base_url>/oommagic/kernels`` answers the kernels this server runs, with their process ids and the
notebooks they belong to, so the sidebar and the report can say "PID 4242 is the kernel of other.ipynb"::

    {
      "version": 1,
      "kernels": [
        {"kernel_id": "4f1c…",        // this server's kernel id
         "pid": 4242,                 // the kernel process's id as this server sees it (null: not a local
                                      //   process, e.g. a remote/gateway kernel)
         "name": "python3",           // the kernel spec
         "notebook": "work/other.ipynb",  // the session's path, or null for a kernel without a session
         "execution_state": "idle"}
      ]
    }

``POST <base_url>/oommagic/kernels/shutdown`` with the JSON body ``{"pid": 4242, "confirm": true}`` shuts
down the kernel whose process has that id and answers ``{"shut_down": "<kernel_id>", "pid": 4242,
"notebook": "work/other.ipynb"}``. It is refused with 400 without ``"confirm": true`` (the person confirmed
in the UI), and with 404 when the PID is not one of *this server's* kernels: the route stops nothing else,
so through it a user can never stop another user's process or any process this server did not start.
Both routes need a login (token or cookie; 403 otherwise) and pass the server's Authorizer (resource
``oommagic``).
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

SCHEMA_VERSION = 1
AUTH_RESOURCE = "oommagic"


def kernel_pid(kernel: Any) -> int | None:
    """The process id of a kernel this server started locally; None for a kernel without a local process."""
    provisioner = getattr(kernel, "provisioner", None)
    for holder in (getattr(provisioner, "process", None), getattr(kernel, "kernel", None)):
        pid = getattr(holder, "pid", None)
        if isinstance(pid, int):
            return pid
    pid = getattr(provisioner, "pid", None)
    return pid if isinstance(pid, int) else None


async def server_kernels(kernel_manager: Any, session_manager: Any) -> list[dict[str, Any]]:
    """Every kernel of this server with its pid and notebook (see the module docstring)."""
    notebooks: dict[str, str] = {}
    if session_manager is not None:
        for session in await session_manager.list_sessions():
            kernel = session.get("kernel") or {}
            if kernel.get("id"):
                notebooks[kernel["id"]] = session.get("path")
    found = []
    for kernel_id in list(kernel_manager.list_kernel_ids()):
        kernel = kernel_manager.get_kernel(kernel_id)
        found.append(
            {
                "kernel_id": kernel_id,
                "pid": kernel_pid(kernel),
                "name": getattr(kernel, "kernel_name", None),
                "notebook": notebooks.get(kernel_id),
                "execution_state": getattr(kernel, "execution_state", None),
            }
        )
    return found


class KernelsHandler(APIHandler):
    """``GET <base_url>/oommagic/kernels``: this server's kernels with their pids and notebooks."""

    auth_resource = AUTH_RESOURCE

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernels = await server_kernels(self.kernel_manager, self.session_manager)
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps({"version": SCHEMA_VERSION, "kernels": kernels}))


class ShutdownHandler(APIHandler):
    """``POST <base_url>/oommagic/kernels/shutdown``: shut down the kernel with the given pid, if it is
    one of this server's kernels and the request says the person confirmed."""

    auth_resource = AUTH_RESOURCE

    @web.authenticated
    @authorized
    async def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
            pid = body["pid"]
        except RecursionError:  # json gives up on nesting deeper than the interpreter's recursion limit
            raise web.HTTPError(
                400, 'the body is nested too deeply to read: expected a JSON body {"pid": N, "confirm": true}'
            ) from None
        except (ValueError, KeyError, TypeError):
            raise web.HTTPError(400, 'expected a JSON body {"pid": N, "confirm": true}') from None
        if type(pid) is not int:
            raise web.HTTPError(400, f"pid must be an integer, got {pid!r}")
        if body.get("confirm") is not True:
            raise web.HTTPError(400, 'nothing is shut down without "confirm": true')
        kernels = await server_kernels(self.kernel_manager, self.session_manager)
        match = next((k for k in kernels if k["pid"] == pid), None)
        if match is None:
            raise web.HTTPError(404, f"PID {pid} is not a kernel of this server: nothing was shut down")
        await self.kernel_manager.shutdown_kernel(match["kernel_id"])
        self.log.info(
            "oommagic: shut down kernel %s (PID %s, %s)", match["kernel_id"], pid, match["notebook"]
        )
        self.finish(json.dumps({"shut_down": match["kernel_id"], "pid": pid, "notebook": match["notebook"]}))
