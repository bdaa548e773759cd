"""Offline link check of the built documentation site: every local href/src exists, every #anchor too.

    python scripts/check_site_links.py site

A link starting with ``/`` is taken from the site's root (mkdocs writes them so in 404.html). Links
to other hosts are listed, not fetched (the check runs without network). Exits 1 on a broken link.
"""
from __future__ import annotations

import html
import os
import re
import sys
from pathlib import Path

ATTR = re.compile(r'\s(?:href|src)="([^"]*)"')
ID = re.compile(r'\sid="([^"]+)"')


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "site").resolve()
    pages = sorted(root.rglob("*.html"))
    ids = {p: set(ID.findall(p.read_text(encoding="utf-8"))) for p in pages}
    broken: list[str] = []
    external: set[str] = set()
    checked = 0
    for page in pages:
        for raw in ATTR.findall(page.read_text(encoding="utf-8")):
            url = html.unescape(raw)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) or url.startswith("//"):
                external.add(url)
                continue
            path, _, frag = url.partition("#")
            path = path.split("?", 1)[0]
            if not path:
                target = page
            elif path.startswith("/"):
                target = root / path.lstrip("/")
            else:
                target = Path(os.path.normpath(page.parent / path))
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(root)}: {url} (no such file)")
            elif frag and target.suffix == ".html" and frag not in ids.get(target, set()):
                broken.append(f"{page.relative_to(root)}: {url} (no such anchor)")
    print(f"{len(pages)} pages, {checked} local links checked, {len(broken)} broken; "
          f"{len(external)} external links not fetched: {', '.join(sorted(external)) or '-'}")
    for line in broken:
        print("  " + line)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
