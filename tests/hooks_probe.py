"""Run under mpiexec by tests/test_process_hooks.py: what process-wide state a layerbraid job
changes, written per rank as JSON to DIR/rank<r>.json.

    mpiexec -n 2 python tests/hooks_probe.py DIR [--early-abort-hook]
"""

import atexit
import json
import sys
import threading
from pathlib import Path


def snapshot():
    return {"excepthook": sys.excepthook, "threading": threading.excepthook,
            "exit": sys.exit, "atexit": atexit._ncallbacks()}


def changed(before, after):
    return sorted(k for k in before if before[k] != after[k])


def main():
    import numpy  # noqa: F401  (torch and MPI register exit handlers of their own)
    import torch  # noqa: F401
    from mpi4py import MPI

    out, early = Path(sys.argv[1]), "--early-abort-hook" in sys.argv
    before = snapshot()
    import layerbraid
    import layerbraid.cli
    import layerbraid.data
    import layerbraid.nn
    import layerbraid.plan  # noqa: F401  (the helpers: importing them changes nothing)
    from layerbraid._comm import mpi as _comm

    after_import = snapshot()
    steady_after_import = layerbraid.launch._steady[0]
    if early:
        layerbraid.launch.abort_on_exception()
    grid = layerbraid.ProcessGrid(MPI.COMM_WORLD, data_parallel=1)
    after_build = snapshot()
    record = {"import": changed(before, after_import), "build": changed(before, after_build),
              "notices": _comm.notices_started(), "atexit_added": after_build["atexit"] -
              before["atexit"], "allocator": [steady_after_import, layerbraid.launch._steady[0]]}
    (out / f"rank{MPI.COMM_WORLD.rank}.json").write_text(json.dumps(record))
    grid.free()


if __name__ == "__main__":
    main()
