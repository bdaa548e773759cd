"""One version: the package metadata reads ``gradcomp.__version__``."""
import configparser
from pathlib import Path

import gradcomp


def test_setup_cfg_reads_the_package_version():
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: gradcomp.__version__"
    assert gradcomp.__version__.count(".") == 2


def _install_block(path: Path) -> list[str]:
    """The ``pip install`` lines and the tested-versions sentence of a page's install section."""
    text = path.read_text()
    lines = [line.strip() for line in text.splitlines() if line.startswith("pip install -e")]
    tested = text.split("Tested versions", 1)[1].split("Or let the Makefile", 1)[0] if "Tested versions" in text else ""
    return lines + [" ".join(tested.split())]


def test_quickstart_installs_as_the_readme_does():
    """docs/quickstart.md and README.md give the same extras, torch range and tested versions."""
    root = Path(__file__).resolve().parents[1]
    readme, quickstart = _install_block(root / "README.md"), _install_block(root / "docs" / "quickstart.md")
    assert readme == quickstart, (readme, quickstart)
    assert any("torch >= 2.4" in line for line in readme)
    pins = dict(line.split("==", 1) for line in (root / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package in ("torch", "pytorch-lightning", "accelerate", "transformers"):
        assert f"{package} {pins[package].strip()}" in readme[-1], (package, pins.get(package), readme[-1])
