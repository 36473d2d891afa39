"""The direct OCI backend: the same hardened containers, started by runc or runsc itself (no
dockerd on the path of a run). Docker stays the image builder and the source of truth for the
configuration.

backend.py   OCIBackend: direct runs, with sessions and networked runs routed to Docker
bundle.py    a direct sandbox's bundle, cgroups and process on the launcher's pipes
teardown.py  the teardown threads and the sweeps of what crashes and dead owners left
kernels.py   session interpreters runsc (or, without an engine, runc) starts directly; checkpoints
bwrap.py     runc-class sandboxes started by bubblewrap from Docker's config
config.py    the OCI config.json: captured from Docker, per-run fields rewritten, parity diff
generate.py  Docker's config made here, without an engine
store.py     each image exported once into a read-only root file system store
shim.py      holds a direct interpreter's stdio across the caller's lifetime
stream.py    a sandbox's stdout/stderr pipes as a protocol Channel
subreaper.py the parent of a runsc sandbox: reaps what runsc leaves behind
"""

from sandloop.runtime.oci.backend import OCIBackend
from sandloop.runtime.oci.bundle import DirectSandbox

__all__ = ["DirectSandbox", "OCIBackend"]
