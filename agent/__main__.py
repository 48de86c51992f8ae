"""`python -m agent` = `agent-client` (how the guest's systemd unit starts it)."""

import sys

from agent.main import main

sys.exit(main())
