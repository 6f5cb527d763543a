"""Routes of the jupyter_server extension; one handler per route, all authenticated.

``GET <base_url>/oommagic/devices`` answers what NVML says about the GPUs of the server's machine
(``oommagic.devices.read_devices``), as JSON for the sidebar's device panel::

    {
      "version": 1,                  // shape of this answer; bumped when a field changes meaning
      "time": 1718000000.123,        // when NVML was read, seconds since the epoch (float)
      "available": true,             // false when NVML could not be loaded or started
      "error": null,                 // why not available, e.g. "NVML Shared Library Not Found"
      "driver": "550.54.15",         // NVIDIA driver version, or null
      "devices": [                   // every GPU NVML lists (empty when not available)
        {
          "nvml_index": 0,           // NVML's order (PCI bus)
          "cuda_index": 0,           // cuda:N for the *server* process, null when CUDA_VISIBLE_DEVICES
                                     //   hides the card (kernels may set their own, see below)
          "uuid": "GPU-8932f937-…",  // or null
          "name": "NVIDIA H200",     // or null
          "used": 3532587008,        // bytes in use on the card (all processes), or null
          "total": 150110011392,     // bytes, or null
          "free": 146577424384,      // bytes, or null
          "processes": [             // processes holding memory on this card
            {"pid": 4242,            // host PID (differs from a PID seen inside a container)
             "name": "/usr/bin/python3",  // or null when NVML may not read it
             "used": 1073741824}     // bytes, or null when NVML does not report it (Windows, MIG)
          ],
          "error": null              // what NVML refused for this card ("memory: GPU is lost");
                                     //   the fields it could read are still filled
        }
      ]
    }

Every byte count is an integer. ``cuda_index`` follows the server's ``CUDA_VISIBLE_DEVICES``; a kernel
started with another value counts its ordinals differently, so match a kernel's device by ``uuid``.
Without a login (token or cookie) the route answers 403 and no figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from traitlets import Float, TraitError, validate
from traitlets.config import LoggingConfigurable

from ..devices import read_devices

SCHEMA_VERSION = 1

# The resource name a custom jupyter_server Authorizer sees for these routes (as "lsp" for jupyter-lsp).
AUTH_RESOURCE = "oommagic"


class OOMMagicDeviceCache(LoggingConfigurable):
    """The last NVML reading, served to every request until it is ``max_age`` seconds old."""

    max_age = Float(
        0.5,
        config=True,
        help="Seconds one NVML reading is served to every open panel before the GPUs are read again.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._answer: dict[str, Any] | None = None
        self._read_at = 0.0
        # Requests arriving during a read wait for that read instead of each starting one.
        self._lock = asyncio.Lock()

    @validate("max_age")
    def _non_negative(self, proposal: dict[str, Any]) -> float:
        if proposal["value"] < 0:
            raise TraitError(f"max_age must be 0 or more seconds, got {proposal['value']}")
        return proposal["value"]

    async def answer(self) -> dict[str, Any]:
        """The route's JSON (see the module docstring); reads NVML on a worker thread when stale."""
        async with self._lock:
            if self._answer is None or time.monotonic() - self._read_at >= self.max_age:
                read_at = time.time()
                # NVML calls block (seconds, when a card is failing): keep them off the event loop.
                report = await asyncio.get_running_loop().run_in_executor(None, read_devices)
                self._answer = {"version": SCHEMA_VERSION, "time": read_at, **report.to_json()}
                self._read_at = time.monotonic()
            return self._answer


class DevicesHandler(APIHandler):
    """``GET <base_url>/oommagic/devices``: the GPUs as NVML sees them (shape in the module docstring)."""

    auth_resource = AUTH_RESOURCE

    def initialize(self, devices: OOMMagicDeviceCache) -> None:
        self.devices = devices

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(await self.devices.answer()))


def setup_handlers(server_app: Any) -> None:
    """Add the routes under the server's ``base_url`` (``/user/alice/`` on JupyterHub)."""
    web_app = server_app.web_app
    base_url = web_app.settings["base_url"]
    from .kernels import KernelsHandler, ShutdownHandler

    devices = OOMMagicDeviceCache(parent=server_app)
    route = url_path_join(base_url, "oommagic", "devices")
    kernels = url_path_join(base_url, "oommagic", "kernels")
    shutdown = url_path_join(base_url, "oommagic", "kernels", "shutdown")
    web_app.add_handlers(
        ".*$",
        [
            (route, DevicesHandler, {"devices": devices}),
            (kernels, KernelsHandler),
            (shutdown, ShutdownHandler),
        ],
    )
