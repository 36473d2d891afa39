"""How E2B's template steps become sandloop's: the package installs the SDK writes become helper
steps (the host fetches; no network in a step), paths resolve against the working directory, a
COPY's uploaded files are laid out as Docker's COPY would, and what cannot run offline is refused."""

from __future__ import annotations

import pytest

from sandloop.server.e2b.service import E2BError
from sandloop.server.e2b.template_steps import absolute as _absolute
from sandloop.server.e2b.template_steps import helper_step as _helper
from sandloop.server.e2b.template_steps import stage_copy as _stage


@pytest.mark.parametrize(
    "command,kind,args",
    [
        ("pip install numpy pandas==2.2.0", "pip_install", ("numpy", "pandas==2.2.0")),
        ("pip install --user requests", "pip_install", ("requests",)),
        ("python3 -m pip install -U scikit-learn", "pip_install", ("scikit-learn",)),
        ("npm install -g typescript", "npm_install", ("typescript",)),
        (
            "DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y --no-install-recommends jq vim",
            "apt_install",
            ("jq", "vim"),
        ),
    ],
)
def test_the_sdks_package_installs_become_helper_steps(command, kind, args):
    step = _helper(command, "step 1")
    assert step is not None and not isinstance(step, str)
    assert (step.kind, step.args) == (kind, args)


def test_apt_update_is_skipped_and_other_commands_run_as_written():
    assert _helper("apt-get update", "step 1") == "skip"
    assert _helper("echo hi", "step 1") is None
    assert _helper("pip install /opt/wheels/x-1.0-py3-none-any.whl", "step 1") is None  # a wheel in the image


def test_a_git_clone_is_refused_with_what_to_do_instead():
    with pytest.raises(E2BError, match="copy\\(\\) it into the template"):
        _helper("git clone https://github.com/x/y.git /app", "step 3")


@pytest.mark.parametrize("command", ["pip install .", "npm install", "pip install --index-url http://evil/ x"])
def test_installs_that_need_a_network_or_a_project_are_refused(command):
    with pytest.raises(E2BError, match="named packages only"):
        _helper(command, "step 2")


@pytest.mark.parametrize(
    "path,workdir,expected",
    [
        ("folder", "/home/user", "/home/user/folder"),
        ("/app", "/home/user", "/app"),
        ("~/x", "/app", "/home/user/x"),
        ("../../../etc", "/home/user", "/etc"),
        ("", "/app", "/app"),
    ],
)
def test_paths_resolve_against_the_working_directory(path, workdir, expected):
    assert _absolute(path, workdir) == expected


def test_a_copy_is_laid_out_as_dockers(tmp_path):
    unpacked = tmp_path / "unpacked"
    (unpacked / "folder").mkdir(parents=True)
    (unpacked / "folder" / "a.txt").write_text("a")
    (unpacked / "folder" / "b.txt").write_text("b")
    (unpacked / "one.txt").write_text("1")
    # a glob's matches go into the destination folder
    assert _stage(unpacked, "folder/*", tmp_path / "s1", "step 1", into_folder=False) == "s1"
    assert sorted(p.name for p in (tmp_path / "s1").iterdir()) == ["a.txt", "b.txt"]
    # a folder brings its contents
    assert _stage(unpacked, "folder", tmp_path / "s2", "step 1", into_folder=False) == "s2"
    # one file to a path not ending in '/' is that file
    assert _stage(unpacked, "one.txt", tmp_path / "s3", "step 1", into_folder=False) == "s3/one.txt"
    assert _stage(unpacked, "one.txt", tmp_path / "s4", "step 1", into_folder=True) == "s4"
    with pytest.raises(E2BError, match="matched no uploaded file"):
        _stage(unpacked, "nothere/*", tmp_path / "s5", "step 1", into_folder=False)
