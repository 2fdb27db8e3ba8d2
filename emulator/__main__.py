"""``python -m emulator``: the SGLang stand-in (same as ``datagen emulator``)."""

import sys

from emulator.cli import main

sys.exit(main())
