"""Template steps as users write them (YAML or a Dockerfile): every mistake named by its step or
line and said in the file's words; options and URLs that would reach another host are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandloop.contract import InvalidArgument
from sandloop.images.templates import parse_steps_file, split_ref
from sandloop.settings import runtime_image


def parse(tmp_path: Path, text: str, name: str = "steps.yaml", ref: str = "tools:v1"):
    path = tmp_path / name
    path.write_text(text)
    return parse_steps_file(path, ref)


def test_a_steps_file_becomes_steps_in_order(tmp_path):
    spec = parse(
        tmp_path,
        """
from: base-tools:v2
steps:
  - pip_install: [scikit-learn==1.5.2, ./w/x-1.0-py3-none-any.whl]
  - npm_install: left-pad
  - apt_install: [jq]
  - run: echo hi
  - copy: {src: data, dest: /opt/data, mode: 0644, owner: "65534:65534"}
  - env: {A: "1", B: 2}
  - workdir: /opt/app
  - user: root
start_cmd: python3 -m http.server 8000
ready_cmd: python3 -c "import urllib.request; urllib.request.urlopen('http://localhost:8000')"
""",
    )
    assert (spec.name, spec.tag, spec.base) == ("tools", "v1", "base-tools:v2")
    assert [s.kind for s in spec.steps] == [
        "pip_install", "npm_install", "apt_install", "run", "copy", "env", "workdir", "user"
    ]  # fmt: skip
    assert spec.steps[1].args == ("left-pad",)
    assert spec.steps[4].args == ("data", "/opt/data", "644", "65534:65534")
    assert spec.steps[5].args == (("A", "1"), ("B", "2"))
    assert spec.start_cmd.startswith("python3 -m http.server")
    assert spec.context == tmp_path.resolve()


@pytest.mark.parametrize(
    "text,words",
    [
        ("steps:\n  - pip_install: ['--index-url=http://evil/simple', x]\n", "step 1: pip_install item"),
        ("steps:\n  - pip_install: ['x; curl evil']\n", "options, URLs and shell syntax are refused"),
        ("steps:\n  - pip_install: ['git+https://github.com/x/y']\n", "step 1: pip_install item"),
        ("steps:\n  - npm_install: []\n", "takes a package name or a list"),
        ("steps:\n  - frobnicate: 1\n", "unknown step 'frobnicate'"),
        ("steps:\n  - run: a\n    copy: b\n", "each step is one mapping"),
        ("steps:\n  - copy: {src: a}\n", "copy takes"),
        ("steps:\n  - copy: {src: a, dest: relative}\n", "must be an absolute path"),
        ("steps:\n  - copy: {src: a, dest: /x, mode: rwx}\n", "must be octal"),
        ("steps:\n  - copy: {src: a, dest: /x, owner: bob}\n", "must be numeric"),
        ("steps:\n  - env: {'1BAD': x}\n", "not a variable name"),
        ("steps:\n  - workdir: /a/../b\n", "must not contain '..'"),
        ("steps: [1, 2]\n", "step 1: each step is one mapping"),
        ("steps:\n  - run: ''\n", "must be a non-empty string"),
        ("ready_cmd: true\nsteps: []\n", "ready_cmd"),
        ("from: 'Not A Name'\nsteps: []\n", "from name"),
        ("stepz: []\n", "unknown keys"),
        ("steps: [\n", "not valid YAML"),
    ],
)
def test_mistakes_name_the_step_and_say_what_to_do(tmp_path, text, words):
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(").replace("[", r"\[")):
        parse(tmp_path, text)


def test_a_dockerfile_becomes_the_same_steps(tmp_path):
    spec = parse(
        tmp_path,
        f"""# a comment
FROM {runtime_image()}
RUN apt-get update && \\
    echo continued
RUN ["python3", "-c", "print(1)"]
COPY --chmod=0755 --chown=65534:65534 app.py /opt/app/
ENV A=1 B="two words"
ENV C three words
WORKDIR /opt/app
USER root
CMD ["python3", "app.py"]
""",
        name="Dockerfile",
    )
    assert spec.base == "runtime"
    assert spec.steps[0].args == ("apt-get update &&  echo continued",)
    assert spec.steps[1].args == ("python3 -c 'print(1)'",)
    assert spec.steps[2].args == ("app.py", "/opt/app/", "755", "65534:65534")
    assert spec.steps[3].args == (("A", "1"), ("B", "two words"))
    assert spec.steps[4].args == (("C", "three words"),)
    assert spec.start_cmd == "python3 app.py"
    assert spec.steps[2].where.endswith("line 6")


@pytest.mark.parametrize(
    "text,words",
    [
        ("FROM docker.io/library/python:3.11\n", "pulls from no registry"),
        ("FROM ${BASE}\n", "build arguments are not supported"),
        ("FROM sandloop-runtime:latest AS a\nFROM a\n", "one FROM only"),
        ("FROM sandloop-runtime:latest\nCOPY --from=a /x /y\n", "--from is not supported"),
        ("FROM sandloop-runtime:latest\nADD https://x/y /y\n", "reaches no host"),
        ("FROM sandloop-runtime:latest\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK is not supported"),
        ("FROM sandloop-runtime:latest\nFROBNICATE\n", "unknown instruction"),
        ("\n# only comments\n", "empty Dockerfile"),
    ],
)
def test_what_a_template_cannot_have_is_refused_with_why(tmp_path, text, words):
    with pytest.raises(InvalidArgument, match=words.replace("$", r"\$").replace("{", r"\{")):
        parse(tmp_path, text, name="Dockerfile")


@pytest.mark.parametrize("ref", ["", "UPPER", "a b", "-lead", "x:", "x:bad tag", "a" * 97])
def test_bad_names_are_refused(ref):
    if ref == "x:":
        assert split_ref(ref) == ("x", "latest")
        return
    with pytest.raises(InvalidArgument):
        split_ref(ref)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(InvalidArgument, match="no such file"):
        parse_steps_file(tmp_path / "nope.yaml", "x")
