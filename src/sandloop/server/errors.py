"""The HTTP API's errors: always ``{code, message}``, the status chosen by the stable code of the
core's error (``SandboxError.code``), never by reading its message."""

from __future__ import annotations

from sandloop.contract import SandboxError

#: HTTP status for each stable error code (``SandboxError.code`` and the API's own).
STATUS = {
    "busy": 429,
    "not_found": 404,
    "session_not_found": 404,
    "context_not_found": 404,
    "session_lost": 410,
    "session_damaged": 500,
    "node_lost": 503,
    "path_refused": 400,
    "too_large": 413,
    "workspace_full": 507,
    "host_disk_full": 507,
    "invalid_argument": 400,
    "invalid_limits": 400,
    "unknown_language": 400,
    "engine_unavailable": 503,
    "image_missing": 503,
    "runtime_unavailable": 503,
    "template_not_found": 404,
    "template_in_use": 409,
    "template_build_failed": 400,
    "snapshot_not_found": 404,
    "snapshot_incompatible": 409,
    "session_paused": 409,
    "session_conflict": 409,
}
RETRY_AFTER = {"busy": 2, "engine_unavailable": 5, "node_lost": 2}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


def error_for(exc: SandboxError) -> ApiError:
    code = exc.code
    # The engine's and image's troubles are the operator's, not the caller's: one code for them.
    # A lost node is the caller's to know (a new call goes to a live node), so it keeps its code.
    public = code
    if STATUS.get(code) == 503 and code != "node_lost":
        public = "engine_unavailable"
    elif code.endswith("not_found"):
        public = "not_found"
    return ApiError(STATUS.get(code, 500), public, str(exc), retry_after=RETRY_AFTER.get(public))
