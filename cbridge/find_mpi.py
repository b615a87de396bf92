"""Which MPI the core is built against: the compiler wrapper, and the pip package that ships it.

Used by the cffi builder (build_mgrit.py) and by setup.py (the wheel's dependencies); no cffi,
no mpi4py needed.
"""
import os
import shlex
import shutil
import sys
from pathlib import Path


def find_mpicc():
    """``(command, where it came from)``: the MPI C compiler wrapper to build with, looked for as
    mpi4py does: ``$MPICC``; the ``mpicc`` next to the running interpreter (a virtual
    environment's, with the pip ``mpich`` wheel installed, even when the environment is not
    activated); the one mpi4py was built with; then PATH."""
    import sys

    if os.environ.get("MPICC"):
        return os.environ["MPICC"], "$MPICC"
    for d in dict.fromkeys([Path(sys.executable).parent, Path(sys.prefix) / "bin"]):
        if (d / "mpicc").is_file() and os.access(d / "mpicc", os.X_OK):
            return str(d / "mpicc"), f"next to the interpreter ({sys.executable})"
    try:
        import mpi4py

        cc = mpi4py.get_config().get("mpicc")
        if cc and shutil.which(shlex.split(cc)[0]):
            return cc, "mpi4py's build configuration"
    except Exception:  # mpi4py absent (an isolated build) or without a config
        pass
    found = shutil.which("mpicc")
    return (found, "PATH") if found else (None, None)


def pip_mpich_version(mpicc):
    """The version of the pip ``mpich`` wheel that ships ``mpicc``, or None (a system MPI)."""
    if not mpicc:
        return None
    path = shutil.which(shlex.split(mpicc)[0])
    if not path:
        return None
    prefix = Path(path).resolve().parent.parent
    for info in sorted(prefix.glob("lib/python*/site-packages/mpich-*.dist-info")):
        return info.name[len("mpich-"):-len(".dist-info")]
    return None
