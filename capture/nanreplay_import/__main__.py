"""python3 -m nanreplay_import FLAGS (with capture/ on sys.path): the same as capture/nanreplay_import.py."""

import sys

from nanreplay_import.cli import main

sys.exit(main())
