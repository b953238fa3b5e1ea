"""The article's markdown -> one self-contained HTML page (and a PDF where a renderer serves).

    python -m bench.report.render paper/article.md --html paper/article.html [--pdf paper/article.pdf]

The HTML embeds every figure as a base64 data URI and has a contents sidebar built from the
headings; nothing outside the file is fetched. The PDF is printed from the same HTML by
WeasyPrint when it is installed (`pip install weasyprint`, which needs Debian's pango);
without it no PDF is written and the command says so. The markdown stays the source.
"""
from __future__ import annotations

import argparse
import base64
import html
import re
import sys
from pathlib import Path

import markdown

CSS = """
body { margin: 0; font: 15px/1.5 -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif;
       color: #1d2125; }
nav { position: fixed; top: 0; left: 0; bottom: 0; width: 250px; overflow-y: auto; padding: 1em 1em 2em;
      background: #f4f5f7; border-right: 1px solid #dde; font-size: 13.5px; box-sizing: border-box; }
nav ul { list-style: none; padding-left: 0.9em; margin: 0.2em 0; }
nav > ul { padding-left: 0; }
nav a { color: #234; text-decoration: none; } nav a:hover { text-decoration: underline; }
nav .title { font-weight: 600; margin-bottom: 0.6em; }
main { margin-left: 250px; padding: 1.5em 2.5em 4em; max-width: 1200px; }
h1 { font-size: 1.7em; line-height: 1.25; }
h2 { border-bottom: 1px solid #ccd; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0 1.4em; font-size: 12.5px; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccd; padding: 3px 7px; vertical-align: top; }
th { background: #eef0f4; text-align: left; } tr:nth-child(even) td { background: #fafbfc; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
code { background: #f1f2f4; padding: 0 3px; border-radius: 3px; font-size: 0.92em; }
em { color: #444; }
@media print {
  nav { display: none; } main { margin: 0; padding: 0; max-width: none; }
  body { font-size: 10pt; } table { font-size: 7.5pt; display: table; width: 100%; }
  th, td { padding: 2px 4px; overflow-wrap: break-word; }
  h2 { page-break-before: always; } h1 + p + h2 { page-break-before: avoid; }
  img { page-break-inside: avoid; max-height: 23cm; } tr { page-break-inside: avoid; }
}
@page { size: A4; margin: 1.4cm 1.2cm; @bottom-center { content: counter(page); font-size: 8pt; } }
"""


def _embed(body: str, base: Path) -> str:
    """Every <img src="relative.png"> -> a data URI of the file (PNG, JPEG, SVG)."""
    kinds = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".svg": "image/svg+xml"}

    def inline(m):
        src = html.unescape(m.group(2))
        path = base / src
        if src.startswith("data:") or not path.exists() or path.suffix.lower() not in kinds:
            return m.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'{m.group(1)}data:{kinds[path.suffix.lower()]};base64,{data}{m.group(3)}'

    return re.sub(r'(<img[^>]*?src=")([^"]+)(")', inline, body)


def _toc(tokens: list[dict], depth: int = 3) -> str:
    def items(ts):
        out = []
        for t in ts:
            if t["level"] > depth:
                continue
            out.append(f'<li><a href="#{t["id"]}">{t["name"]}</a>{items(t["children"])}</li>')
        return f"<ul>{''.join(out)}</ul>" if out else ""
    # the title (h1) is the sidebar's heading; its sections are the list
    top = tokens[0]["children"] if len(tokens) == 1 else tokens
    title = tokens[0]["name"] if len(tokens) == 1 else "Contents"
    return f'<div class="title">{title}</div>{items(top)}'


def _breakable_stacks(body: str) -> str:
    """A line may break after each '+' of a stack in a table cell ("checkpointing+<wbr>lomo"):
    a cell of long stacks then wraps instead of widening the table past the page."""
    return re.sub(r"<td([^>]*)>(.*?)</td>", lambda m: f"<td{m.group(1)}>{m.group(2).replace('+', '+<wbr>')}</td>",
                  body, flags=re.S)


def to_html(text: str, base: Path) -> str:
    """The article's markdown -> a complete HTML page, figures embedded, contents sidebar."""
    md = markdown.Markdown(extensions=["tables", "toc", "attr_list", "sane_lists"],
                           extension_configs={"toc": {"toc_depth": "1-3"}})
    body = _embed(_breakable_stacks(md.convert(text)), base)
    title = re.search(r"^# (.+)$", text, re.M)
    title = html.escape(title.group(1)) if title else "membench"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
            f"<style>{CSS}</style></head><body><nav>{_toc(md.toc_tokens)}</nav><main>{body}</main></body></html>\n")


def to_pdf(page: str, pdf: Path) -> bool:
    """Print the HTML page to a PDF with WeasyPrint; False where it is not installed."""
    try:
        from weasyprint import HTML
    except (ImportError, OSError) as e:  # OSError: pango missing
        print(f"render: no PDF ({e.__class__.__name__}: {e}); pip install weasyprint for one", file=sys.stderr)
        return False
    tmp = pdf.with_name(pdf.name + ".tmp")
    HTML(string=page).write_pdf(tmp)
    tmp.replace(pdf)
    return True


def render(md_path: Path, html_path: Path, pdf_path: Path | None = None) -> list[Path]:
    """Write the HTML page (and the PDF where possible); the paths written."""
    page = to_html(Path(md_path).read_text(), Path(md_path).parent)
    tmp = Path(html_path).with_name(Path(html_path).name + ".tmp")
    tmp.write_text(page)
    tmp.replace(html_path)
    made = [Path(html_path)]
    if pdf_path is not None and to_pdf(page, Path(pdf_path)):
        made.append(Path(pdf_path))
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report.render",
                                description="Markdown article -> self-contained HTML (and PDF).")
    p.add_argument("markdown")
    p.add_argument("--html", required=True)
    p.add_argument("--pdf")
    args = p.parse_args(argv)
    made = render(Path(args.markdown), Path(args.html), Path(args.pdf) if args.pdf else None)
    print("render: " + ", ".join(map(str, made)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
