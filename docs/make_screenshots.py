"""Screenshots of the report widget at 1400×900: a CPU training cell that runs out under --limit, and the
same widget after its recommended fix ran. Renders the widget's static HTML (``view.static``) in headless
Chromium; no JupyterLab needed.

    PYTHONPATH=. python docs/make_screenshots.py      # writes docs/report-oom.png, docs/report-fitted.png
"""

from __future__ import annotations

import html
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELL = """%%gpumem --limit 48MiB --plan-budget 30 -o failed --quiet --no-raise
batch_size = 64
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    x = torch.randn(batch_size, 64, 256)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def shoot(page: str, name: str, height: int = 900) -> Path:
    src = HERE / f"{name}.html"
    src.write_text(page, encoding="utf-8")
    png = HERE / f"{name}.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--hide-scrollbars",
            f"--screenshot={png}",
            f"--window-size=1400,{height}",
            src.as_uri(),
        ],
        check=True,
        capture_output=True,
    )
    src.unlink()
    return png


def main() -> int:
    from IPython.core.interactiveshell import InteractiveShell

    from oommagic.run.session import session_for
    from oommagic.view.static import report_html
    from oommagic.view.widget import ReportWidget

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "oommagic")
    shell.run_cell("import torch")
    # The first dispatch mode of a process pays torch's imports (seconds on CPU): not this cell's time.
    shell.run_cell("%%gpumem --quiet\ntorch.ones(1)")
    shell.run_cell(CELL)
    failed = shell.user_ns["failed"]
    widget = ReportWidget(failed, session_for(shell))
    prompt = f"<pre style='color:#555;margin:0 0 8px 0'>{html.escape(CELL.strip())}</pre>"
    print(shoot(report_html(widget, prompt), "report-oom"))
    print(shoot(report_html(widget, prompt), "report-oom-whole", height=2000))
    widget.click(widget.fixes[0].kind)
    print(shoot(report_html(widget, prompt), "report-fitted"))
    print(shoot(report_html(widget, prompt), "report-fitted-whole", height=2000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
