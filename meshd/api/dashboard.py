"""The dashboard's files: one page, its script and its style, shipped in `meshd/api/static/`.

Rules: the files hold nothing of the mesh (the page reads `/v1/meshd/status` and streams through
`/v1/chat/completions`, sending the API token when there is one), so they are served without the
token; the page loads nothing from elsewhere, and its Content-Security-Policy tells the browser so.
"""

from __future__ import annotations

import functools
from importlib import resources

ASSETS = {"/": ("dashboard.html", "text/html; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
HEADERS = [(b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; "
                                        b"img-src 'self' data:; connect-src 'self'; form-action 'none'; "
                                        b"frame-ancestors 'none'; base-uri 'none'"),
           (b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-cache")]


@functools.cache
def asset(path: str) -> tuple[bytes, str] | None:
    """The body and content type of the dashboard file at `path`, or None if it is not one."""
    if path not in ASSETS:
        return None
    name, ctype = ASSETS[path]
    return (resources.files("meshd.api") / "static" / name).read_bytes(), ctype
