"""`python -m agentic_sandbox.images ...` (see agentic_sandbox.images.cli)."""

import sys

from agentic_sandbox.images.cli import main

sys.exit(main())
