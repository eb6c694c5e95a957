"""`nanreplay import`'s helper, as the command runs it: python3 nanreplay_import.py FLAGS --out DIR.

The code is the package nanreplay_import/ beside this file (its __init__ says what each module holds;
docs/import.md, "Layout"). This launcher puts its own directory first on sys.path, so the package and
nanreplay_capture.py are found whatever the working directory, and runs the package's main. (Imported
with this directory on sys.path, `nanreplay_import` is the package, not this file.)
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nanreplay_import.cli import main

    sys.exit(main())
