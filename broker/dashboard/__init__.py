"""The browser dashboard: static assets served at `/`, xterm.js from the npm registry."""

from broker.dashboard.assets import install_dashboard

__all__ = ["install_dashboard"]
