"""A report widget as one static HTML page: what it shows, without a frontend (a saved copy, an export,
a screenshot). Walks the widget tree: HTML as is, the plot inline, buttons and pickers as their HTML
look-alikes at the widget's sizes."""

from __future__ import annotations

import base64
import html
from typing import Any

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; font-size: 13px; color: #222;
       margin: 16px 24px; }}
button {{ font: inherit; border: 1px solid #bbb; background: #eee; border-radius: 2px; margin: 2px 4px 2px 0;
         overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }}
button.primary {{ background: #2196f3; color: white; border-color: #1976d2; }}
select {{ font: inherit; margin: 2px 6px 2px 0; }}
code {{ background: #f3f3f3; padding: 0 0.25em; border-radius: 2px; }}
.cell {{ border-left: 2px solid #ddd; padding-left: 12px; max-width: 1000px; }}
</style></head><body>{prompt}<div class="cell">{body}</div></body></html>"""


def report_html(widget: Any, prompt: str = "") -> str:
    """The widget's current look as a standalone HTML page; ``prompt`` (HTML) goes above it, as the cell's
    source would in a notebook."""
    return _PAGE.format(prompt=prompt, body=_render(widget.root))


def _render(node: Any) -> str:
    layout = getattr(node, "layout", None)
    if layout is not None and getattr(layout, "display", None) == "none":
        return ""
    kind = type(node).__name__
    if kind == "HTML":
        return node.value
    if kind == "Image":
        if not node.value:
            return ""
        data = base64.b64encode(node.value).decode()
        return f"<div><img src='data:image/png;base64,{data}' style='max-width:760px'></div>"
    if kind == "Button":
        style = f"width:{layout.width or 'auto'};height:{layout.height or 'auto'}"
        cls = " class='primary'" if node.button_style == "primary" else ""
        tip = html.escape(node.tooltip or "")
        return f"<button{cls} style='{style}' title='{tip}'>{html.escape(node.description)}</button>"
    if kind == "Dropdown":
        label = f"{html.escape(node.description)} " if node.description else ""
        chosen = next((text for text, value in node.options if value == node.value), "")
        width = layout.width or "auto"
        return f"{label}<select style='width:{width}'><option>{html.escape(chosen)}</option></select>"
    if kind == "Output":
        text = "".join(o.get("text", "") for o in node.outputs if o.get("output_type") == "stream")
        return f"<pre style='margin:0.2em 0'>{html.escape(text)}</pre>" if text else ""
    children = getattr(node, "children", ())
    inner = "".join(_render(c) for c in children)
    if kind == "Accordion":
        titles = getattr(node, "titles", ()) or ("",) * len(children)
        return "".join(
            f"<details{' open' if node.selected_index == i else ''}>"
            f"<summary>{html.escape(title or '')}</summary>{_render(child)}</details>"
            for i, (title, child) in enumerate(zip(titles, children, strict=False))
        )
    if kind == "HBox":
        return f"<div style='display:flex;flex-wrap:wrap;align-items:center'>{inner}</div>"
    return f"<div>{inner}</div>"
