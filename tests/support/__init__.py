"""Shared test support: real server and agent-client processes, a session WebSocket client."""
