"""``python -m gradcomp ...``: see ``gradcomp.cli``."""
import sys

from .cli import main

sys.exit(main())
