"""`python -m agentic_sandbox.agent` = `agent-client` (how the guest's systemd unit starts it)."""

import sys

from agentic_sandbox.agent.main import main

sys.exit(main())
