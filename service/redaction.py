"""What may be shown of a configured URL: anonymous /v1/info and error messages carry no
credentials (user:password@) and no query string (where API keys travel)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def without_credentials(url: str) -> str:
    """`url` without its user:password@ and its query string."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
