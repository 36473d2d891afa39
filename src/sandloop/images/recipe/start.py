"""The sandbox's entry point (the image's ENTRYPOINT): one program (``launcher.py``), or with
``--kernel`` a session's interpreters (``kernel.py``); both loaded from the bytecode the image
compiled at build (a script is compiled from source on every start, ~1.5 ms of each cold run)."""

import sys

import launcher

launcher.prepare()
if sys.argv[1:2] == ["--kernel"]:
    import kernel

    kernel.serve(sys.argv[2:])
    sys.exit(0)
launcher.run_one()
