"""cffi builder for layerbraid's MGRIT core (out-of-line API mode).

The compiler and link flags come from ``$MPICC`` or the ``mpicc`` on PATH (``mpicc -show``), so
that the core and mpi4py use one MPI.  Nothing is downloaded.
"""
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from cffi import FFI

# cffi runs this file by path (setup.py's cffi_modules): its folder is not on sys.path.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from find_mpi import find_mpicc  # noqa: E402

HERE = Path(__file__).resolve().parent
SOURCES = sorted(str(p.relative_to(HERE.parent)) for p in (HERE / "src").glob("*.c"))

HEADER = HERE / "include" / "mgrit.h"


def cdef_from_header(text):
    """The cffi declarations of mgrit.h, taken from the header itself: its constants, types and
    functions (comments and preprocessor lines dropped, MPI_Comm opaque), and one
    ``extern "Python"`` function per field of ``mgrit_callbacks``, named ``_lb_<field>``."""
    body = text.split('extern "C" {', 1)[1]
    body = body[body.index("#endif") + len("#endif"):body.rindex("#ifdef __cplusplus")]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    lines = [ln for ln in body.splitlines()
             if ln.strip() and (not ln.lstrip().startswith("#") or re.match(
                 r"#define\s+MGRIT_\w+\s+-?\d+\s*$", ln.strip()))]
    callbacks = re.search(r"typedef struct mgrit_callbacks \{(.*?)\} mgrit_callbacks;", body,
                          flags=re.S).group(1)
    externs = [f'extern "Python" int _lb_{name}({args});'
               for name, args in re.findall(r"int \(\*(\w+)\)\(([^)]*)\);", callbacks)]
    return "\n".join(["typedef ... MPI_Comm;"] + lines + externs) + "\n"


CDEF = cdef_from_header(HEADER.read_text())


def _mpicc_flags():
    """Include dirs, library dirs, libraries and rpaths from `mpicc -show`."""
    mpicc, origin = find_mpicc()
    if not mpicc:
        raise RuntimeError(
            "layerbraid needs an MPI C compiler wrapper to build its core and found none: not "
            "$MPICC, not next to the interpreter, not in mpi4py's configuration, not on PATH. "
            "`pip install mpich` provides one in the virtual environment; or set $MPICC"
        )
    print(f"layerbraid: building the MGRIT core with {mpicc} (from {origin})", file=sys.stderr)
    out = None
    for flag in ("-show", "--showme"):  # MPICH, then Open MPI
        try:
            out = subprocess.run(shlex.split(mpicc) + [flag], capture_output=True, text=True,
                                 check=True).stdout
            break
        except (subprocess.CalledProcessError, OSError):
            continue
    if out is None:
        raise RuntimeError(f"could not read the flags of {mpicc!r} with -show or --showme")
    inc, libdirs, libs, rpath, extra = [], [], [], [], []
    args = shlex.split(out)[1:]
    k = 0
    while k < len(args):
        a = args[k]
        if a.startswith("-I"):
            inc.append(a[2:])
        elif a.startswith("-L"):
            libdirs.append(a[2:])
        elif a.startswith("-l"):
            libs.append(a[2:])
        elif a == "-Wl,-rpath" and k + 1 < len(args) and args[k + 1].startswith("-Wl,"):
            rpath.append(args[k + 1][4:])
            k += 1
        elif a.startswith("-Wl,-rpath,"):
            rpath.append(a[len("-Wl,-rpath,"):])
        elif a.startswith("-Wl,"):
            extra.append(a)
        k += 1
    return dict(include_dirs=inc, library_dirs=libdirs, libraries=libs,
                runtime_library_dirs=rpath, extra_link_args=extra)


# Note [finding libmpi at run time]
# The extension needs libmpi.so.N but must not remember where the build found it: a wheel is
# built in one (often temporary) environment and installed in another.  So no absolute RUNPATH.
# Loading works because (1) layerbraid._bridge imports mpi4py.MPI before the extension, and
# mpi4py locates and loads the MPI library itself; the dynamic loader then satisfies our
# DT_NEEDED entry with the library already in the process, matched by its soname, without a
# path search; and (2) as a fallback for a bare import of the extension, RUNPATH holds
# $ORIGIN/../../.., which from <prefix>/lib/pythonX.Y/site-packages/layerbraid/ is <prefix>/lib,
# where the pip `mpich` wheel puts libmpi in the same environment.  A system MPI is found in
# the system's library path.
_RUNPATH = ["$ORIGIN/../../.."]

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_flags = _mpicc_flags()
_flags["runtime_library_dirs"] = _RUNPATH
ffibuilder.set_source(
    "layerbraid._mgrit_core",
    '#include "mgrit.h"\n',
    sources=SOURCES,
    include_dirs=[str(Path("cbridge") / "include"), str(Path("cbridge") / "src")]
    + _flags.pop("include_dirs"),
    extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    **_flags,
)

if __name__ == "__main__":
    os.chdir(HERE.parent)
    ffibuilder.compile(verbose=True)
