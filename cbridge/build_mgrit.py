"""cffi builder for layerbraid's MGRIT core (out-of-line API mode).

The compiler and link flags come from ``$MPICC`` or the ``mpicc`` on PATH (``mpicc -show``), so
that the core and mpi4py use one MPI.  Nothing is downloaded.
"""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = sorted(str(p.relative_to(HERE.parent)) for p in (HERE / "src").glob("*.c"))

CDEF = """
typedef int64_t mgrit_vec;
typedef ... MPI_Comm;
typedef struct { int32_t level; int32_t op; int64_t index; int32_t peer; int32_t done; }
    mgrit_trace_entry;
typedef struct {
  int (*init)(void *, double, int64_t, mgrit_vec *);
  int (*clone)(void *, mgrit_vec, mgrit_vec *);
  int (*free)(void *, mgrit_vec);
  int (*sum)(void *, double, mgrit_vec, double, mgrit_vec);
  int (*norm)(void *, mgrit_vec, double *);
  int (*step)(void *, mgrit_vec, double, double, int, int64_t, int, mgrit_vec *);
  int (*bufsize)(void *, mgrit_vec, int64_t *);
  int (*pack)(void *, mgrit_vec, void *, int64_t);
  int (*unpack)(void *, void *, int64_t, mgrit_vec *);
  int (*coarsen)(void *, mgrit_vec, int, mgrit_vec *);
  int (*refine)(void *, mgrit_vec, int, mgrit_vec *);
} mgrit_callbacks;
typedef struct mgrit_core mgrit_core;

#define MGRIT_OK 0
#define MGRIT_ERR_ARG 1
#define MGRIT_ERR_CALLBACK 2
#define MGRIT_ERR_REMOTE 3
#define MGRIT_ERR_NAN 4
#define MGRIT_ERR_MPI 5
#define MGRIT_ERR_NOMEM 6
#define MGRIT_ERR_MISMATCH 7
#define MGRIT_CYCLE_V 0
#define MGRIT_CYCLE_F 1

int mgrit_create(MPI_Comm *comm, int64_t num_steps, double tstart, double tstop,
                 const mgrit_callbacks *callbacks, void *app, mgrit_core **out);
int mgrit_destroy(mgrit_core *core);
int mgrit_create_virtual(int64_t num_steps, double tstart, double tstop, int rank, int size,
                         mgrit_core **out);
int mgrit_set_max_levels(mgrit_core *core, int max_levels);
int mgrit_set_cfactors(mgrit_core *core, int n, const int *cfactors);
int mgrit_set_nrelax(mgrit_core *core, int n, const int *nrelax);
int mgrit_set_max_iters(mgrit_core *core, int max_iters);
int mgrit_set_tol(mgrit_core *core, double tol);
int mgrit_set_skip(mgrit_core *core, int skip);
int mgrit_set_cycle(mgrit_core *core, int cycle);
int mgrit_set_min_coarse(mgrit_core *core, int64_t min_coarse);
int mgrit_set_final_fc(mgrit_core *core, int final_fc);
int mgrit_set_trace(mgrit_core *core, int on);
int mgrit_set_store_all(mgrit_core *core, int store_all);
int mgrit_set_mirror(mgrit_core *core, int mirror);
int mgrit_setup(mgrit_core *core);
int mgrit_solve(mgrit_core *core);
int mgrit_num_levels(const mgrit_core *core);
int mgrit_iterations(const mgrit_core *core);
int mgrit_num_norms(const mgrit_core *core);
const double *mgrit_norms(const mgrit_core *core);
void mgrit_owned(const mgrit_core *core, int level, int64_t *lo, int64_t *hi);
mgrit_vec mgrit_state(const mgrit_core *core, int64_t index);
int64_t mgrit_level_points(const mgrit_core *core, int level);
int64_t mgrit_level_stride(const mgrit_core *core, int level);
int mgrit_failed_rank(const mgrit_core *core);
double mgrit_comm_seconds(const mgrit_core *core);
const char *mgrit_error_message(const mgrit_core *core);
int64_t mgrit_trace_length(const mgrit_core *core);
const mgrit_trace_entry *mgrit_trace(const mgrit_core *core);

extern "Python" int _lb_init(void *, double, int64_t, mgrit_vec *);
extern "Python" int _lb_clone(void *, mgrit_vec, mgrit_vec *);
extern "Python" int _lb_free(void *, mgrit_vec);
extern "Python" int _lb_sum(void *, double, mgrit_vec, double, mgrit_vec);
extern "Python" int _lb_norm(void *, mgrit_vec, double *);
extern "Python" int _lb_step(void *, mgrit_vec, double, double, int, int64_t, int, mgrit_vec *);
extern "Python" int _lb_bufsize(void *, mgrit_vec, int64_t *);
extern "Python" int _lb_pack(void *, mgrit_vec, void *, int64_t);
extern "Python" int _lb_unpack(void *, void *, int64_t, mgrit_vec *);
extern "Python" int _lb_coarsen(void *, mgrit_vec, int, mgrit_vec *);
extern "Python" int _lb_refine(void *, mgrit_vec, int, mgrit_vec *);
"""


def _mpicc_flags():
    """Include dirs, library dirs, libraries and rpaths from `mpicc -show`."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        raise RuntimeError(
            "layerbraid needs an MPI C compiler wrapper to build its core: set $MPICC or put "
            "`mpicc` on PATH (`pip install mpich` provides one in the virtual environment)"
        )
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
