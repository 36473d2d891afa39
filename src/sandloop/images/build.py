"""Build the runtime image offline: debootstrap -> PyPI wheels -> ``docker import`` -> Dockerfile.

No registry is needed. The base (Debian packages + wheels) and the runtime image (base + launcher)
are tagged by a hash of their recipe files, so each is rebuilt only when its recipe changes.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from sandloop.contract import SandboxError
from sandloop.images.recipe_hash import RECIPE_DIR, RUNTIME_FILES, SUITE, base_tag
from sandloop.runtime.docker import DockerBackend, DockerImages

Progress = Callable[[str], None]
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: The moving alias that always points at the newest build.
LATEST = "sandloop-runtime:latest"


def debian_mirror() -> str:
    """``SANDLOOP_DEBIAN_MIRROR`` (settings), else the first Debian mirror in this machine's apt sources."""
    from sandloop.settings import Settings

    configured = Settings().debian_mirror
    if configured:
        return configured
    candidates: list[Path] = [Path("/etc/apt/sources.list")]
    sources_d = Path("/etc/apt/sources.list.d")
    if sources_d.is_dir():
        candidates += sorted(sources_d.iterdir())
    for path in candidates:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                words = line.split()
                if not words:
                    continue
                if words[0] == "URIs:":
                    uris = words[1:]
                elif words[0] == "deb":
                    uris = [w for w in words[1:] if "://" in w][:1]
                else:
                    continue
                for uri in uris:
                    if uri.rstrip("/").endswith("/debian"):
                        return uri.rstrip("/")
    return DEFAULT_MIRROR


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _run(cmd: list[str], progress: Progress, what: str) -> None:
    progress(f"{what}: {' '.join(cmd[:4])} ...")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-15:]
        if line.startswith(("I: Retrieving", "I: Configuring", "Collecting", "Downloading")):
            progress(f"{what}: {line[:100]}")
    if proc.wait() != 0:
        raise SandboxError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def _unmount_below(root: Path) -> None:
    """debootstrap may leave proc/sys mounted in the target if it fails; never rmtree through them."""
    with contextlib.suppress(OSError):
        mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()]
        for mnt in sorted((m for m in mounts if m.startswith(str(root) + "/")), reverse=True):
            subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)


def _node_packages(target: Path, progress: Progress) -> None:
    """The npm packages of ``node-packages.txt`` (TypeScript, for the sessions' TypeScript
    contexts), fetched with the host's npm as tarballs and unpacked where the image's node finds
    them (``NODE_PATH``). No install scripts run: a package is its tarball's files."""
    specs = _lines(RECIPE_DIR / "node-packages.txt")
    if not specs:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SandboxError(
            "building the base image needs npm on the host for "
            + ", ".join(specs)
            + " (apt-get install npm, or Node.js's own installer)"
        )
    with tempfile.TemporaryDirectory(prefix="sandloop-npm-") as tmp:
        _run([npm, "pack", "--silent", "--pack-destination", tmp, *specs], progress, "npm pack")
        for tarball in sorted(Path(tmp).glob("*.tgz")):
            name = tarball.name.rsplit("-", 1)[0]
            dest = target / name
            dest.mkdir(parents=True, exist_ok=True)
            unpack = ["tar", "-xzf", str(tarball), "-C", str(dest), "--strip-components=1", "--no-same-owner"]
            _run(unpack, progress, "unpack " + name)


def build_base(images: DockerImages, progress: Progress) -> str:
    tag = base_tag()
    if images.exists(tag):
        progress(f"base image {tag} is up to date")
        return tag
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        raise SandboxError(
            "building the base image offline needs root and debootstrap (apt-get install debootstrap). "
            "On a machine that can pull images, build from the Dockerfile instead: "
            "`sandloop images build --from debian:bookworm-slim`."
        )
    packages = _lines(RECIPE_DIR / "packages.txt")
    from sandloop.settings import Settings

    workdir = Path(tempfile.mkdtemp(prefix="sandloop-rootfs-", dir=str(Settings().build_dir)))
    rootfs = workdir / "rootfs"
    try:
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(packages)}",
                SUITE,
                str(rootfs),
                debian_mirror(),
            ],
            progress,
            "debootstrap",
        )
        pyver = sorted(p.name for p in (rootfs / "usr/lib").glob("python3.[0-9]*"))[-1].removeprefix("python")
        target = rootfs / f"usr/local/lib/python{pyver}/dist-packages"
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
                str(target),
                "--only-binary=:all:",
                "--implementation",
                "cp",
                "--python-version",
                pyver,
                "--platform",
                f"manylinux2014_{platform.machine()}",
                "--platform",  # bookworm's glibc is 2.36: wheels built for 2.28 run (pillow 12's)
                f"manylinux_2_28_{platform.machine()}",
                "-r",
                str(RECIPE_DIR / "requirements.txt"),
            ],
            progress,
            "pip wheels",
        )
        _node_packages(rootfs / "usr/local/lib/node_modules", progress)
        for junk in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/locale",
        ):
            path = rootfs / junk
            if path.is_dir():
                for child in path.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        progress(f"importing the root filesystem as {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            images.import_rootfs(tar.stdout, tag)
        finally:
            if tar.stdout:
                tar.stdout.close()
            if tar.wait() != 0:
                raise SandboxError(f"tar of the root filesystem failed (exit {tar.returncode})")
        return tag
    finally:
        _unmount_below(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


def build_runtime(
    *, base: str | None = None, force: bool = False, progress: Progress = print, backend: DockerBackend | None = None
) -> str:
    """Build (or find) the runtime image and return its name.

    ``base`` None builds the base offline (debootstrap); a name such as ``debian:bookworm-slim``
    builds the Dockerfile straight from it (needs a registry or that image present).
    """
    backend = backend or DockerBackend()
    images = DockerImages(backend)
    from sandloop.settings import runtime_image

    image = runtime_image()
    if not force and images.exists(image):
        progress(f"runtime image {image} is up to date")
        return image
    base_image = base or build_base(images, progress)
    context = Path(tempfile.mkdtemp(prefix="sandloop-build-"))
    try:
        for name in RUNTIME_FILES:
            shutil.copy2(RECIPE_DIR / name, context / name)
        progress(f"building {image} from {base_image}")
        images.build(str(context), image, {"BASE": base_image}, on_line=lambda ln: progress(f"docker build: {ln}"))
    finally:
        shutil.rmtree(context, ignore_errors=True)
    images.tag(image, LATEST)
    progress(f"built {image}")
    return image
