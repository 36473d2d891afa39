"""Local packages for template tests (no registry is reached): a wheel made by hand and an npm
tarball made with the host's npm from a folder."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str = "tinypkg", version: str = "1.0", body: str = "ANSWER = 41 + 1\n") -> str:
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sandloop-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(content.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)
    return f"./{wheel.name}"


def make_npm_tarball(folder: Path, name: str = "tiny-npm") -> str:
    source = folder / f"{name}-src"
    source.mkdir()
    package = {"name": name, "version": "1.0.0", "main": "index.js", "bin": {name: "cli.js"}}
    (source / "package.json").write_text(json.dumps(package))
    (source / "index.js").write_text("module.exports = { answer: 42 };\n")
    (source / "cli.js").write_text('#!/usr/bin/env node\nconsole.log("tiny cli", require("./index.js").answer)\n')
    (source / "cli.js").chmod(0o755)
    subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(folder)], cwd=source, check=True)
    return f"./{name}-1.0.0.tgz"
