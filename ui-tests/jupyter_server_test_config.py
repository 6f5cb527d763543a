"""Jupyter server for the browser tests: JupyterLab on port 8888 with Galata's in-page helpers.

Started by Playwright (``webServer`` in ``playwright.config.ts``), which also passes the token, the port
and a fresh temporary root directory on the command line. Not for use outside the tests: the
workspace is thrown away and the app is exposed to the page as ``window.jupyterapp``.
"""

import tempfile
from pathlib import Path

import jupyterlab

c = get_config()  # noqa: F821 (provided by the config loader)

c.ServerApp.port_retries = 0
# CI containers run as root.
c.ServerApp.allow_root = True
c.ServerApp.open_browser = False
# Galata's helpers (window.galata) ship with JupyterLab as a prebuilt extension in this folder.
c.LabServerApp.extra_labextensions_path = str(Path(jupyterlab.__file__).parent / "galata")
c.LabApp.workspaces_dir = tempfile.mkdtemp(prefix="oommagic-ui-workspaces-")
c.LabApp.expose_app_in_browser = True
# No news or update checks reaching out to the internet during tests.
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
# Notebook 7's page (the `notebook` package, served by the same server) exposes its app the same way.
c.JupyterNotebookApp.expose_app_in_browser = True
