"""`python -m agentic_sandbox.provision` = provision/provision-vm.sh."""

import sys

from agentic_sandbox.provision.cli import main

sys.exit(main())
