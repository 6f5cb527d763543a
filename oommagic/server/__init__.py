"""The jupyter_server extension: authenticated routes under ``<base_url>/oommagic/`` that the JupyterLab
sidebar reads. Enabled by ``jupyter-config/server-config/oommagic.json``; the routes are in
``handlers.py``.
"""

from __future__ import annotations

from typing import Any

from .handlers import DevicesHandler, OOMMagicDeviceCache, setup_handlers

__all__ = ["DevicesHandler", "OOMMagicDeviceCache"]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Called by jupyter_server at start-up (the extension point ``oommagic/__init__.py`` declares)."""
    setup_handlers(server_app)
    server_app.log.info("oommagic: GPU device route at %soommagic/devices", server_app.base_url)
