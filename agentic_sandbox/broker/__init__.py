"""The management server (`sandbox-server`). Nothing imports `broker`."""
