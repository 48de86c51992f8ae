"""Serves the dashboard page, its scripts and the vendored npm packages (xterm.js).

The npm packages are not served from `node_modules` (a wheel never holds it): `scripts/install.sh`
runs `npm ci` and copies the files the page loads into `vendor/` beside this module, which the
package data ships. A server whose `vendor/` lacks one of them refuses to start and names it.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).with_name("static")
VENDOR_DIR = Path(__file__).with_name("vendor")

#: Files of the vendored packages the page loads (URL /vendor/<path>).
VENDORED_FILES = (
    "xterm/lib/xterm.js",
    "xterm/css/xterm.css",
    "xterm-addon-fit/lib/addon-fit.js",
)


class DashboardAssetsMissing(Exception):
    """The vendored assets the dashboard page loads are not installed."""


def missing_assets(vendor_dir: Path = VENDOR_DIR) -> list[str]:
    return [name for name in VENDORED_FILES if not (vendor_dir / name).is_file()]


async def index(_request: web.Request) -> web.FileResponse:
    # Content-Type up front: FileResponse sets it only while preparing, after the security
    # middleware has looked for text/html to add the CSP.
    return web.FileResponse(
        STATIC_DIR / "index.html",
        headers={"Cache-Control": "no-cache", "Content-Type": "text/html; charset=utf-8"},
    )


def install_dashboard(app: web.Application, vendor_dir: Path = VENDOR_DIR) -> None:
    missing = missing_assets(vendor_dir)
    if missing:
        raise DashboardAssetsMissing(
            f"dashboard assets missing in {vendor_dir}: {', '.join(missing)} — run "
            "scripts/install.sh (npm ci, then copies them) before starting or building a wheel"
        )
    app.router.add_get("/", index, name="dashboard")
    app.router.add_static("/static/", STATIC_DIR, name="dashboard-static")
    app.router.add_static("/vendor/", vendor_dir, name="dashboard-vendor")
