"""Serves the dashboard page, its scripts and the vendored npm packages (xterm.js).

The npm packages are not served from `node_modules` (a wheel never holds it): `scripts/install.sh`
runs `npm ci` and copies the files the page loads into `vendor/` beside this module, which the
package data ships. A server whose `vendor/` lacks one of them refuses to start and names it.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from agentic_sandbox.broker.http.middleware import SESSION_COOKIE
from agentic_sandbox.broker.http.routing import PRINCIPAL_KEY

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


INDEX_KEY: web.AppKey[str] = web.AppKey("dashboard_index", str)
SESSION_MARK = '<meta name="sandbox-session" content="signed-out">'


async def index(request: web.Request) -> web.Response:
    """The page, saying whether this browser's session cookie is valid (the auth middleware
    has resolved it), so that a signed-out page shows its form without asking the API — an
    anonymous probe on every load would be a refusal, audited and shown as `auth.denied`. A
    cookie that no longer signs anyone in is cleared."""
    signed_in = request.get(PRINCIPAL_KEY) is not None
    page = request.app[INDEX_KEY]
    if signed_in:
        page = page.replace(SESSION_MARK, SESSION_MARK.replace("signed-out", "signed-in"), 1)
    resp = web.Response(
        text=page, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-cache"}
    )
    if not signed_in and SESSION_COOKIE in request.cookies:
        resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


def install_dashboard(app: web.Application, vendor_dir: Path = VENDOR_DIR) -> None:
    missing = missing_assets(vendor_dir)
    if missing:
        raise DashboardAssetsMissing(
            f"dashboard assets missing in {vendor_dir}: {', '.join(missing)} — run "
            "scripts/install.sh (npm ci, then copies them) before starting or building a wheel"
        )
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    if SESSION_MARK not in page:
        raise DashboardAssetsMissing(f"{STATIC_DIR / 'index.html'} lacks {SESSION_MARK}")
    app[INDEX_KEY] = page
    app.router.add_get("/", index, name="dashboard")
    app.router.add_static("/static/", STATIC_DIR, name="dashboard-static")
    app.router.add_static("/vendor/", vendor_dir, name="dashboard-vendor")
