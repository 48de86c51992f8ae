"""`python -m images ...` (see images.cli)."""

import sys

from images.cli import main

sys.exit(main())
