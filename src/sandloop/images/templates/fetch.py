"""Packages for a template's helper steps, fetched on the host by the host's own clients, in
modes that run no package code here: the way the runtime image's build reaches the mirrors this
host is configured for (PyPI, npm's registry, Debian's), and nothing else. The build container
that installs them has no network at all.

- ``pip_install``: ``pip download --only-binary=:all:`` for the image's Python and platform (a
  wheel is unpacked, never built: an sdist would run its setup code on the host);
- ``npm_install``: ``npm install --ignore-scripts`` into a folder of its own (no install scripts:
  a package with a native addon has no build of it);
- ``apt_install``: ``apt-get install --download-only`` against the image's own dpkg status
  (what the image lacks, with its dependencies), from the host's package lists.

Local files (``./wheels/x.whl``, ``./pkg.tgz``) are read from the template's folder only.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sandloop.contract import InvalidArgument, SandboxError
from sandloop.runtime.base import PACKAGES_DIR

Progress = Callable[[str], None]
#: The runtime image's Python and the newest glibc its wheels may need (bookworm: 2.36).
IMAGE_PYTHON = "3.11"
_MANYLINUX = ("manylinux2014", "manylinux_2_28", "manylinux_2_36")


def is_local(item: str) -> bool:
    return item.startswith(("./", "../", "/")) or item.endswith((".whl", ".tgz", ".tar.gz", ".deb"))


def local_file(context: Path, item: str, where: str) -> Path:
    """A package file named relative to the template's folder, which it must not leave."""
    path = (context / item).resolve()
    if not path.is_relative_to(context.resolve()):
        raise InvalidArgument(f"{where}: {item} is outside the template's folder ({context})")
    if not path.is_file():
        raise InvalidArgument(f"{where}: {item}: no such file in the template's folder ({context})")
    return path


def check_remote(item: str, where: str) -> None:
    if "://" in item or " @ " in item or item.startswith(("git+", "file:")):
        raise InvalidArgument(
            f"{where}: {item!r} names a URL; a template's packages come from the mirrors this host is configured "
            "for (a name and version), or from a file in the template's folder"
        )


def _run(argv: list[str], what: str, progress: Progress, cwd: Path | None = None) -> None:
    progress(f"{what}: {' '.join(argv[:3])} ...")
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=1800)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise SandboxError(f"{what} failed on the host (exit {proc.returncode}):\n" + "\n".join(tail))


def pip_packages(items: tuple[str, ...], context: Path, dest: Path, where: str, progress: Progress) -> list[str]:
    """Wheels for ``items`` (and their dependencies) into ``dest``; what to install there."""
    args, wanted = [], []
    for item in items:
        if is_local(item):
            path = local_file(context, item, where)
            if not path.name.endswith(".whl"):
                raise InvalidArgument(f"{where}: {item}: only wheels (.whl) install from a file: nothing is built here")
            shutil.copy2(path, dest / path.name)
            args.append(str(dest / path.name))
            wanted.append(f"{PACKAGES_DIR}/{path.name}")
        else:
            check_remote(item, where)
            args.append(item)
            wanted.append(item)
    platforms = [f"--platform={p}_{platform.machine()}" for p in _MANYLINUX]
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:"]
    argv += [*platforms, "--implementation=cp", f"--python-version={IMAGE_PYTHON}", "-d", str(dest), *args]
    _run(argv, "pip download", progress)
    return wanted


def npm_packages(items: tuple[str, ...], context: Path, dest: Path, where: str, progress: Progress) -> Path:
    """``node_modules`` for ``items`` in ``dest`` (no install scripts run); returns it."""
    npm = shutil.which("npm")
    if npm is None:
        raise SandboxError(f"{where}: npm_install needs npm on the host (apt-get install npm)")
    args = []
    for item in items:
        if is_local(item):
            args.append(str(local_file(context, item, where)))
        else:
            check_remote(item, where)
            args.append(item)
    (dest / "package.json").write_text('{"name": "sandloop-template-packages", "private": true}\n')
    argv = [npm, "install", "--ignore-scripts", "--no-audit", "--no-fund", "--no-package-lock", "--prefix", str(dest)]
    _run([*argv, *args], "npm install", progress, cwd=dest)
    return dest / "node_modules"


def apt_packages(items: tuple[str, ...], dpkg_status: bytes, dest: Path, where: str, progress: Progress) -> list[str]:
    """The .deb files the image lacks for ``items`` (with dependencies) into ``dest``."""
    apt = shutil.which("apt-get")
    if apt is None:
        raise SandboxError(f"{where}: apt_install needs Debian's apt-get on the host")
    for item in items:
        check_remote(item, where)
        if is_local(item):
            raise InvalidArgument(f"{where}: apt_install takes package names ({item} is a file)")
    status = dest.parent / "dpkg-status"
    status.write_bytes(dpkg_status)
    archives = dest
    (archives / "partial").mkdir(exist_ok=True)
    options = [
        f"-oDir::State::status={status}",
        f"-oDir::Cache::archives={archives}",
        "-oDebug::NoLocking=1",
        "-oAPT::Install-Recommends=0",
    ]
    lists = Path("/var/lib/apt/lists")
    if not any(lists.glob("*_Packages*")):
        _run([apt, "update", "-q"], "apt-get update", progress)
    _run([apt, *options, "install", "--download-only", "-y", "-q", *items], "apt-get download", progress)
    shutil.rmtree(archives / "partial", ignore_errors=True)
    (archives / "lock").unlink(missing_ok=True)
    return sorted(p.name for p in archives.glob("*.deb"))
