"""The project's exception hierarchy; the HTTP layer maps each class to one status code."""

from __future__ import annotations


class R4TError(Exception):
    """Base class for every error r4t raises on purpose."""

    http_status = 500


class InputError(R4TError):
    """The caller sent something we cannot serve (bad query, bad k, bad catalog line)."""

    http_status = 422


class CatalogError(InputError):
    """A catalog file is missing or malformed; the message names the file and line."""


class BundleError(R4TError):
    """A bundle is missing, partial, corrupted or of an unknown format."""

    http_status = 503


class BundleAbsentError(BundleError):
    """No bundle at the path yet (no manifest): not built, or a build has not written it."""


class OverloadError(R4TError):
    """The path cannot answer in time (queue full or expected wait too long); retry later."""

    http_status = 429

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # the wait estimate behind the refusal, if any


class DeadlineError(R4TError):
    """The request's deadline passed before an answer was ready."""

    http_status = 504


class UnavailableError(R4TError):
    """A route is not loaded or not ready."""

    http_status = 503


class IndexUnavailableError(UnavailableError):
    """The vector engine cannot be reached or cannot answer; every route needs it (no fallback)."""
