"""Image names derived from the recipe's content (``images/recipe/``), so an image is rebuilt only
when it changes. A fact on the ground floor: settings name the default runtime image by it, and the
image build (``images/``), which stands above settings, builds that name."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

RECIPE_DIR = Path(__file__).parent / "images" / "recipe"
#: Files that make up the base (debootstrap + wheels) and the full runtime image.
BASE_FILES = ("packages.txt", "requirements.txt", "node-packages.txt")
RUNTIME_FILES = (
    "Dockerfile",
    "start.py",
    "launcher.py",
    "host_wire.py",
    "kernel.py",
    "kernel_python.py",
    "kernel_bash.py",
    "kernel_wire.py",
    "kernel.js",
    "egress_relay.py",
    "egress-fetch.js",
    "sandloop_stdio.js",
    "sandloop_stdio.py",
    "sandloop_stdio.pth",
    "sudo",
    *BASE_FILES,
)
#: Bump to force a rebuild when the build procedure itself changes.
BUILD_VERSION = "1"
SUITE = "bookworm"


def _digest(files: tuple[str, ...]) -> str:
    h = hashlib.sha256(f"{BUILD_VERSION}:{SUITE}".encode())
    for name in files:
        h.update(name.encode() + b"\0")
        h.update((RECIPE_DIR / name).read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:12]


@functools.cache
def recipe_hash() -> str:
    return _digest(RUNTIME_FILES)


def base_tag() -> str:
    return f"sandloop-base:{_digest(BASE_FILES)}"


def default_runtime_image() -> str:
    """The runtime image this version's recipe builds."""
    return f"sandloop-runtime:{recipe_hash()}"
