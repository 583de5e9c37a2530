"""A service stand-in for tests/integration/test_forkserver.py: writes what it finds itself to be
(environment, session, threads, command line) to the file its first argument names, after computing in
parallel; then waits for that file to be removed, or exits with the code its second argument gives."""

import json
import os
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":
    out, code = Path(sys.argv[1]), int(sys.argv[2])
    a = torch.randn(512, 512)
    product = (a @ a).sum().item()  # a parallel region in a forked child: libgomp must not hang here
    print("probe: computed", product)
    out.write_text(json.dumps({
        "pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(), "argv": sys.argv,
        "threads": torch.get_num_threads(), "probe_var": os.environ.get("PROBE_VAR"),
        "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
        "main": sys.modules["__main__"].__name__}))
    while code < 0 and out.exists():
        time.sleep(0.1)
    sys.exit(max(code, 0))
