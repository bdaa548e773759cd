"""The documentation site's hooks (scripts/mkdocs_hooks.py), without building the site.

The API pages show the values of the constants their signatures name (``{{ value NAME }}``), and
link the guides the docstrings name by path; ``make docs`` builds the whole site (strict).
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from tests.mpi_launch import ROOT


def hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_values_are_read_from_the_package():
    h = hooks()
    from gradcomp.optim import diloco

    assert h.with_values("H = {{ value gradcomp.optim.diloco.SYNC_EVERY }}") == f"H = `{diloco.SYNC_EVERY!r}`"
    with pytest.raises(ValueError, match="does not resolve"):
        h.with_values("{{ value gradcomp.optim.diloco.NO_SUCH_NAME }}")
    # every value a page asks for resolves, and the API pages show the defaults their signatures name
    pages = {p.relative_to(ROOT / "docs").as_posix(): p.read_text() for p in (ROOT / "docs").rglob("*.md")}
    for text in pages.values():
        h.with_values(text)
    for page, name in (("api/optim.md", "SYNC_EVERY"), ("api/torch.md", "OUTER_LR"), ("api/jax.md", "OUTER_MOMENTUM"),
                       ("api/optim.md", "WARMUP_COMPRESSOR"), ("api/gradcomp.md", "LARGE_ALLREDUCE_BYTES")):
        assert re.search(rf"`{name}`.*\{{\{{ value [\w.]+\.{name} \}}\}}", pages[page]), (page, name)


def test_api_pages_link_the_guides_docstrings_name():
    h = hooks()
    html = ('<p>see docs/guides/local-steps.md and <code>BENCHMARKS.md</code>, section 3</p>'
            '<pre><code>docs/guides/ddp.md</code></pre><a href="x">docs/guides/jax.md</a>')
    out = h.linked(html, "api/torch.md", {"guides/local-steps.md": "Local steps: DiLoCo"})
    assert '<a href="../guides/local-steps.html">Local steps: DiLoCo</a>' in out
    assert '<code><a href="../benchmarks.html">BENCHMARKS.md</a></code>, section 3' in out
    assert "<pre><code>docs/guides/ddp.md</code></pre>" in out and '<a href="x">docs/guides/jax.md</a>' in out
    with pytest.raises(ValueError, match="not a page of the site"):
        h.linked("docs/guides/no-such-guide.md", "api/torch.md")
