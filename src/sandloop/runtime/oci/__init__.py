"""The direct OCI backend: the same hardened containers, started by runc or runsc itself (no
dockerd on the path of a run). Docker stays the image builder and the source of truth for the
configuration.

backend.py  OCIBackend: direct runs, with sessions and networked runs routed to Docker
config.py   the OCI config.json: captured from Docker, per-run fields rewritten, parity diff
store.py    each image exported once into a read-only root file system store
stream.py   a sandbox's stdout/stderr pipes as a protocol Channel
subreaper.py  the parent of a runsc sandbox: reaps what runsc leaves behind
"""

from sandloop.runtime.oci.backend import DirectSandbox, OCIBackend

__all__ = ["DirectSandbox", "OCIBackend"]
