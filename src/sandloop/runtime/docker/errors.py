"""docker-py and requests exceptions mapped to sandloop's errors, in exactly this one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import requests.exceptions

import docker.errors
from sandloop.contract import EngineUnavailable, ImageMissing, InvalidLimits, RuntimeUnavailable, SandboxError


@contextlib.contextmanager
def engine_errors(image: str | None = None, runtime: str | None = None) -> Iterator[None]:
    """Map docker-py and requests exceptions to sandloop's ``SandboxError`` tree."""
    try:
        yield
    except SandboxError:
        raise
    except docker.errors.ImageNotFound as exc:
        raise ImageMissing(
            f"image {image!r} is not on this Docker engine. Build it with `sandloop images build` (or `make images`)."
        ) from exc
    except docker.errors.APIError as exc:
        text = str(exc.explanation or exc)
        lowered = text.lower()
        if "error setting rlimit" in lowered:
            # the engine's own processes have a lower ceiling than the one asked for (open_files)
            raise InvalidLimits(
                f"the Docker engine could not give the sandbox these limits ({text}); ask for less (open_files), "
                "or raise the engine's own limit (LimitNOFILE of docker.service and containerd.service)"
            ) from exc
        unknown_runtime = "unknown runtime" in lowered or "runtime not found" in lowered or "no such runtime" in lowered
        if unknown_runtime or ("runtime" in lowered and "not found" in lowered and "oci runtime" not in lowered):
            raise RuntimeUnavailable(
                f"the Docker engine has no {runtime!r} runtime ({text}). Register gVisor with "
                "scripts/engine-up.sh, or use runtime='runc'."
            ) from exc
        if exc.status_code == 404 and "image" in lowered:
            raise ImageMissing(
                f"image {image!r} is not on this Docker engine. Build it with `sandloop images build`."
            ) from exc
        if exc.status_code == 400:
            # The engine validates a container's configuration (memory floor, CPU range, ...) with 400.
            raise InvalidLimits(f"the Docker engine refused these limits: {text}") from exc
        # 403, 409 and the rest are the engine's state, not the caller's limits.
        raise EngineUnavailable(f"the Docker engine failed ({exc.status_code}): {text}") from exc
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        raise EngineUnavailable(
            f"the Docker engine did not answer ({type(exc).__name__}). Start it with "
            "scripts/engine-up.sh (or your system's service manager) and check `docker info`."
        ) from exc
    except docker.errors.DockerException as exc:
        raise EngineUnavailable(
            f"cannot reach a Docker engine: {exc}. Start one with scripts/engine-up.sh, "
            "or set DOCKER_HOST, then check `docker info`."
        ) from exc
