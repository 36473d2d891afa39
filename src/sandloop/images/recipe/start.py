"""The sandbox's entry point (the image's ENTRYPOINT): the launcher, loaded from the bytecode the
image compiled at build (see ``launcher.entry``)."""

import launcher

launcher.entry()
