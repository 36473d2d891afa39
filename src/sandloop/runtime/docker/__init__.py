"""The Docker engine backend: the only package in sandloop that imports ``docker``.

backend.py    DockerBackend: sandboxes, a session's interpreter, workspaces, housekeeping
hardening.py  SandboxLimits as a container configuration
errors.py     docker-py and requests exceptions mapped to sandloop's, in one place
stream.py     the attach socket as a protocol Channel (Docker's 8-byte frames)
workspace.py  loop-mounted ext4 workspaces as named volumes
images.py     image import and build for the offline recipe
"""

from sandloop.runtime.docker.backend import DockerBackend, LiveSandbox
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.docker.images import DockerImages

__all__ = ["DockerBackend", "DockerImages", "LiveSandbox", "engine_errors"]
