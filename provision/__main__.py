"""`python -m provision` = provision/provision-vm.sh."""

import sys

from provision.cli import main

sys.exit(main())
