"""PTY sessions: the hub, the attach WebSocket, recordings (see contract.py)."""
