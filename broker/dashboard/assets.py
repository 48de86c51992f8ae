"""Serves the dashboard page, its scripts and the vendored npm packages (xterm.js)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).with_name("static")
NODE_MODULES = Path(__file__).with_name("node_modules")

# npm packages the page loads, by URL prefix → folder inside node_modules
VENDORED = {
    "/vendor/xterm/": "@xterm/xterm",
    "/vendor/xterm-addon-fit/": "@xterm/addon-fit",
}


async def index(_request: web.Request) -> web.FileResponse:
    # Content-Type up front: FileResponse sets it only while preparing, after the security
    # middleware has looked for text/html to add the CSP.
    return web.FileResponse(
        STATIC_DIR / "index.html",
        headers={"Cache-Control": "no-cache", "Content-Type": "text/html; charset=utf-8"},
    )


def install_dashboard(app: web.Application) -> None:
    app.router.add_get("/", index, name="dashboard")
    app.router.add_static("/static/", STATIC_DIR, name="dashboard-static")
    for prefix, package in VENDORED.items():
        folder = NODE_MODULES / package
        if folder.is_dir():
            app.router.add_static(
                prefix, folder, name="vendor-" + package.strip("@").replace("/", "-")
            )
