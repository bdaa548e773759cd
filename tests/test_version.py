"""One version: the package metadata reads ``gradcomp.__version__``."""
import configparser
from pathlib import Path

import gradcomp


def test_setup_cfg_reads_the_package_version():
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: gradcomp.__version__"
    assert gradcomp.__version__.count(".") == 2
