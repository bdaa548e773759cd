"""The benchmarks use gradcomp's public API only (DESIGN.md: they stand above everything).

Read from the source (``ast``), not run: no ``from gradcomp... import _name``, no module whose
path has a private part, nothing from the kernels' modules or ``compressors.pieces`` (``INTERNAL``),
no ``module._name`` on a gradcomp module, no ``_keyword=`` argument, and no assignment into a
gradcomp module (the pieces ablation goes through
``gradcomp.compressors.set_two_stage_pieces``, not ``pieces.MAX_PIECES = n``).
"""
from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
#: implementation modules: the kernels (whose public faces are the codecs) and the pieces knob
INTERNAL = ("gradcomp.kernels", "gradcomp.compressors.quantize.kernels", "gradcomp.compressors.pieces")


def private_uses(source: str) -> list[str]:
    """What ``source`` reaches of gradcomp that is not public, as 'line: what' strings."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to gradcomp modules or their members
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("gradcomp"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradcomp"):
            modules.update(a.asname or a.name for a in node.names)
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{node.lineno}: module {node.module}")
            found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                      or f"{node.module}.{a.name}".startswith(INTERNAL) or node.module.startswith(INTERNAL)]
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
            found.append(f"{node.value.lineno}: keyword {node.arg}=")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in modules:
                found.append(f"{node.lineno}: assigns {target.value.id}.{target.attr}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{node.lineno}: {base.id}...{node.attr}")
    return found


def test_the_check_sees_what_the_benchmarks_once_did():
    once = ("from gradcomp.compressors.quantize.kernels import _compiled\n"
            "from gradcomp.compressors import pieces\npieces.MAX_PIECES = 1\n"
            "import gradcomp.torch.hook as hookmod\nnamed = hookmod._named_hook\n"
            "from gradcomp import GradientReducer\nGradientReducer([], None, _groups=[[0]])\n")
    assert sorted({int(use.split(":")[0]) for use in private_uses(once)}) == [1, 2, 3, 5, 7], private_uses(once)
    assert private_uses("import gradcomp\nfrom gradcomp.compressors import set_two_stage_pieces\n"
                        "set_two_stage_pieces(1)\ngradcomp.GradientReducer([], None, buckets=[[0]])\n") == []


def test_benchmarks_use_the_public_api_only():
    found = {str(p.relative_to(BENCHMARKS)): uses for p in sorted(BENCHMARKS.rglob("*.py"))
             if "tests" not in p.parts and (uses := private_uses(p.read_text()))}
    assert not found, found
