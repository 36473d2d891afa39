"""Build the runtime image offline: debootstrap -> PyPI wheels -> ``docker import`` -> Dockerfile;
or, for a host without Docker, the same steps straight into the direct backend's store
(``build_rootfs``: the Dockerfile's steps applied by ``_apply_recipe``).

No registry is needed. The base (Debian packages + wheels) and the runtime image (base + launcher)
are tagged by a hash of their recipe files, so each is rebuilt only when its recipe changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError
from sandloop.paths import unmount_below
from sandloop.recipe_hash import RECIPE_DIR, RUNTIME_FILES, SUITE, base_tag, recipe_hash
from sandloop.runtime.docker import DockerBackend, DockerImages
from sandloop.runtime.oci.generate import DEFAULT_PATH

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


def _require_debootstrap() -> None:
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        raise SandboxError(
            "building the base image offline needs root and debootstrap (apt-get install debootstrap). "
            "On a machine that can pull images, build from the Dockerfile instead: "
            "`sandloop images build --from debian:bookworm-slim`."
        )


def _base_rootfs(rootfs: Path, progress: Progress) -> None:
    """The base (packages.txt by debootstrap, requirements.txt's wheels, node-packages.txt) in ``rootfs``."""
    packages = _lines(RECIPE_DIR / "packages.txt")
    _run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(rootfs), debian_mirror()],
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
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        path = rootfs / junk
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def build_base(images: DockerImages, progress: Progress) -> str:
    tag = base_tag()
    if images.exists(tag):
        progress(f"base image {tag} is up to date")
        return tag
    _require_debootstrap()
    from sandloop.settings import Settings

    workdir = Path(tempfile.mkdtemp(prefix="sandloop-rootfs-", dir=str(Settings().build_dir)))
    rootfs = workdir / "rootfs"
    try:
        _base_rootfs(rootfs, progress)
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
        unmount_below(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


def _recipe_run(rootfs: Path, command: str, env: dict[str, str], workdir: str, progress: Progress, where: str) -> None:
    """A ``RUN`` of the runtime recipe inside ``rootfs``, as ``docker build`` runs it: ``/bin/sh
    -c`` as root of the image, with the ENV so far; here by bubblewrap with no network, no
    capabilities and its own pid, ipc and uts namespaces (uid 0 owns the image's files)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("building the runtime image without Docker needs bubblewrap (apt-get install bubblewrap)")
    argv = [bwrap, "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--cap-drop", "ALL"]
    argv += ["--die-with-parent", "--new-session", "--chdir", workdir or "/", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    _run([*argv, "/bin/sh", "-c", command], progress, where)


def _apply_recipe(rootfs: Path, progress: Progress) -> dict[str, Any]:
    """The runtime recipe's Dockerfile applied to a base root file system, as ``docker build``
    applies it (COPY from the recipe, RUN, ENV, WORKDIR, ENTRYPOINT, CMD; ARG and FROM name the
    base, which is ``rootfs``). Returns the image's config as ``docker inspect`` shows it."""
    from sandloop.images.templates.spec import dockerfile_env, dockerfile_lines, json_list

    env = {"PATH": DEFAULT_PATH}  # docker build gives an image without one Docker's default, first
    config: dict[str, Any] = {"Env": [], "Cmd": None, "WorkingDir": "", "Entrypoint": None}
    for number, line in dockerfile_lines((RECIPE_DIR / "Dockerfile").read_text()):
        where = f"Dockerfile line {number}"
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word in ("ARG", "FROM"):
            continue
        if word == "COPY":
            *sources, dest = shlex.split(rest)
            for name in sources:
                target = rootfs / (dest + name if dest.endswith("/") else dest).lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(RECIPE_DIR / name, target)
                os.chown(target, 0, 0)
        elif word == "RUN":
            _recipe_run(rootfs, rest, env, config["WorkingDir"], progress, f"{where}: RUN")
        elif word == "ENV":
            env.update(dockerfile_env(rest, where))
        elif word == "WORKDIR":
            config["WorkingDir"] = rest
            (rootfs / rest.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif word in ("ENTRYPOINT", "CMD"):
            config["Entrypoint" if word == "ENTRYPOINT" else "Cmd"] = json_list(rest, where)
        else:
            raise SandboxError(f"{where}: {word} is not applied by the build without Docker")
    config["Env"] = [f"{k}={v}" for k, v in env.items()]
    _init_layer(rootfs)
    return config


def _init_layer(rootfs: Path) -> None:
    """What Docker's init layer puts in every container's root (moby's daemon/initlayer): empty
    /etc/hostname, /etc/hosts and /etc/resolv.conf (not the host's resolver), /.dockerenv and
    /dev/console (a plain file, not the device debootstrap made), and
    /etc/mtab as a link to /proc/mounts; so a sandbox sees the same files with or without Docker."""
    for name in (".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf", "dev/console"):
        path = rootfs / name
        path.unlink(missing_ok=True)
        path.touch(mode=0o755)
        path.chmod(0o755)
    mtab = rootfs / "etc/mtab"
    mtab.unlink(missing_ok=True)
    mtab.symlink_to("/proc/mounts")


#: Bump when ``build_rootfs`` itself changes (its output is then built again).
ROOTFS_BUILD = "2"


def build_rootfs(*, store: Path, force: bool = False, progress: Progress = print) -> str:
    """Build (or find) the runtime image without Docker, straight into the direct backend's store
    (``<store>/images``), for a backend with ``engine=false``; return its name. The same recipe as
    ``build_runtime``: debootstrap, the wheels, the Dockerfile's steps (``_apply_recipe``)."""
    from sandloop.runtime.oci.store import BUILT, IMAGE_CONFIG, RootfsStore
    from sandloop.settings import runtime_image

    image = runtime_image()
    images = RootfsStore(store / "images", _no_engine, engine=False)
    image_id = f"built-{recipe_hash()}-{ROOTFS_BUILD}"
    # One build at a time per store, between processes too (two test workers, a CLI beside a
    # server): the second waits, then finds the first's build up to date.
    with images.across_processes():
        if not force and images.has(image) and images.image_id(image) == image_id:
            progress(f"runtime image {image} is up to date in {images.directory}")
            return image
        _require_debootstrap()
        images.directory.mkdir(parents=True, exist_ok=True)
        work = images.directory / f".build-{uuid.uuid4().hex[:8]}"
        work.mkdir(mode=0o700)
        try:
            _base_rootfs(work / "rootfs", progress)
            config = _apply_recipe(work / "rootfs", progress)
            (work / IMAGE_CONFIG).write_text(json.dumps(config))
            (work / BUILT).write_text(f"{image}\n")
            work.chmod(0o755)
            final = images.directory / image_id
            if final.exists():  # --force: the old copy goes (runs that have it mounted keep theirs)
                old = images.directory / f".build-old-{uuid.uuid4().hex[:8]}"
                subprocess.run(["umount", "-l", str(final / "rootfs")], capture_output=True, check=False)
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            work.rename(final)
            for name in (image, LATEST):
                images.add_ref(name, image_id)
        finally:
            if work.exists():
                unmount_below(work)
                shutil.rmtree(work, ignore_errors=True)
    progress(f"built {image} into {images.directory / image_id}")
    return image


def _no_engine() -> Any:
    raise SandboxError("internal error: the build without Docker asked the engine")


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
