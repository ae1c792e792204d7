"""One self-contained ``report.html``: the verdicts, then every plot embedded as a base64 PNG."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from asyncgrpo.report.diagnose import Verdict
from asyncgrpo.report.plots import Panel

_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; background: #fff; }
.verdict { border-left: 6px solid #2a7; padding: .4em .8em; margin: .6em 0; background: #f4fbf6; }
.verdict.bad { border-color: #d33; background: #fdf3f3; }
.verdict table { font-size: .9em; border-collapse: collapse; }
.verdict td { padding: 0 1em 0 0; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
.plots img { width: 640px; max-width: 100%; }
"""


def _verdict_html(v: Verdict) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(val)}</td></tr>" for k, val in v.figures.items())
    cls = "verdict" if v.healthy else "verdict bad"
    return (
        f'<div class="{cls}"><b>{html.escape(v.table)}</b>: {html.escape(v.diagnosis)}.<br>'
        f"<i>What to do:</i> {html.escape(v.action)}.<table>{rows}</table></div>"
    )


def write_html(path: Path, title: str, verdicts: list[Verdict], panels: list[tuple[Panel, Path]], note: str) -> None:
    """Write the page; images are inlined so the file can be mailed or opened anywhere on its own."""
    body = [f"<h1>{html.escape(title)}</h1>", f"<p>{html.escape(note)}</p>", "<h2>Diagnosis</h2>"]
    body += [_verdict_html(v) for v in verdicts] or ["<p>Not enough metrics for any diagnosis table.</p>"]
    body.append('<h2>Curves</h2><div class="plots">')
    for panel, png in panels:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        body.append(f'<img alt="{html.escape(panel.title)}" src="data:image/png;base64,{data}">')
    body.append("</div>")
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>"
    )
    path.write_text(page)
