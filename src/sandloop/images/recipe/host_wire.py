"""The host's wire on the sandbox's stdin, as every program of the image reads it (the one-shot
launcher, ``launcher.py``; a session's interpreters, ``kernel.py``): the preamble and its exact reads,
the header's ``ca`` (``trust``), failures of the sandbox's own (exit 125) and the exit status of a
``SystemExit``. The host's side is ``runtime/protocol.py``."""

import os
import sys

PREAMBLE = b"SANDLOOP1 "
PREAMBLE_LEN = len(PREAMBLE) + 9  # 8 digits and a newline


def fail(message):
    os.write(2, ("sandloop: " + message + "\n").encode())
    os._exit(125)


def read_exact(n, what):
    chunks = []
    while n > 0:
        chunk = os.read(0, min(n, 1 << 20))
        if not chunk:
            fail("stdin closed before the whole %s arrived" % what)
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def exit_status(code):
    """What the interpreter does with SystemExit.code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def trust(ca_pem):
    """Trust one more CA (the egress proxy's, which reads this run's HTTPS to put secrets in) in
    every TLS client here: OpenSSL (Python, curl, git), requests, pip, Node."""
    bundle = "/tmp/.sandloop-ca.pem"
    try:
        with open("/etc/ssl/certs/ca-certificates.crt") as f:
            system = f.read()
    except OSError:
        system = ""
    fd = os.open(bundle, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(system + "\n" + ca_pem)
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"):
        os.environ[name] = bundle
