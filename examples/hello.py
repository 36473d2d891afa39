import getpass
import os
import platform
import sys

import numpy as np

print(f"hello from python {platform.python_version()} inside the sandbox")
print(f"running as uid {os.getuid()} ({getpass.getuser()}), pid {os.getpid()}")
print(f"numpy says 6 * 7 = {int(np.multiply(6, 7))}")
print("this line goes to stderr", file=sys.stderr)
