"""The browser dashboard: static assets served at `/`, xterm.js from the npm registry."""

from agentic_sandbox.broker.dashboard.assets import DashboardAssetsMissing, install_dashboard

__all__ = ["DashboardAssetsMissing", "install_dashboard"]
