"""mkdocs hooks (``mkdocs.yml``: ``hooks:``) for the API reference pages, built from docstrings.

* ``{{ value gradcomp.optim.diloco.SYNC_EVERY }}`` in a page's markdown becomes the constant's
  value, read from the installed package, so a page that names a default shows what it is (the
  signatures show the constant's name). A name that does not resolve fails the build.
* In the API pages (``api/``), a path the docstrings name, ``docs/guides/local-steps.md`` or
  ``BENCHMARKS.md``, becomes a link to that page of the site, titled as the navigation titles it (docstrings
  name paths, which read well in ``help()``; the site links them). Code blocks are left alone.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

VALUE = re.compile(r"\{\{\s*value\s+([A-Za-z_][\w.]*)\s*\}\}")
# a docs page named by its path (inside <code> or not), never inside a tag, a link or a code block
PATH = re.compile(r"\b(docs/(?:guides/)?[\w-]+\.md|BENCHMARKS\.md)")
PRE = re.compile(r"(<pre\b.*?</pre>|<a\b.*?</a>|<[^>]*>)", re.S)
DOCS = Path(__file__).resolve().parents[1] / "docs"


def value(dotted: str) -> str:
    """``repr`` of the attribute ``dotted`` (``package.module.NAME``)."""
    module, _, name = dotted.rpartition(".")
    try:
        return repr(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"mkdocs_hooks: {{{{ value {dotted} }}}} does not resolve: {exc}") from None


def with_values(markdown: str) -> str:
    return VALUE.sub(lambda m: f"`{value(m.group(1))}`", markdown)


def _target(path: str) -> Path:
    """The docs source a named path stands for (``BENCHMARKS.md`` is included by benchmarks.md)."""
    return DOCS / ("benchmarks.md" if path == "BENCHMARKS.md" else path.removeprefix("docs/"))


def nav_titles(nav: object) -> dict[str, str]:
    """``{"guides/ddp.md": "PyTorch DDP", ...}`` from mkdocs.yml's ``nav``."""
    found: dict[str, str] = {}
    items = nav if isinstance(nav, list) else []
    for item in items:
        for title, target in (item.items() if isinstance(item, dict) else []):
            if isinstance(target, str):
                found[target] = title
            else:
                found.update(nav_titles(target))
    return found


def linked(html: str, page_uri: str, titles: dict[str, str] | None = None) -> str:
    """``html`` of the page at ``page_uri`` (``api/torch.md``) with named docs paths linked, each
    titled as the navigation titles its page (``titles``), else by the path."""
    depth = page_uri.count("/")

    def link(m: re.Match[str]) -> str:
        source = _target(m.group(1))
        if not source.is_file():
            raise ValueError(f"mkdocs_hooks: {page_uri} names {m.group(1)}, which is not a page of the site")
        uri = source.relative_to(DOCS).as_posix()
        href = "../" * depth + uri.removesuffix(".md") + ".html"
        return f'<a href="{href}">{(titles or {}).get(uri, m.group(1))}</a>'

    return "".join(part if PRE.fullmatch(part) else PATH.sub(link, part) for part in PRE.split(html))


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs' objects)
    return with_values(markdown)


def on_page_content(html: str, page, config, files) -> str:  # noqa: ANN001
    uri = page.file.src_uri
    return linked(html, uri, nav_titles(config["nav"])) if uri.startswith("api/") else html
