import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "cbridge"))
from find_mpi import find_mpicc, pip_mpich_version  # noqa: E402

# What the package needs to run.  torch: any CPU or CUDA build from 2.6 on (a user picks it).
# MPI: the one the core is compiled against; when that is the pip `mpich` wheel, the wheel
# depends on its major version (the same libmpi ABI), so that a fresh environment gets it.
REQUIRES = ["numpy", "cffi>=1.15", "mpi4py>=3.1", "torch>=2.6"]
_mpich = pip_mpich_version(find_mpicc()[0])
if _mpich:
    REQUIRES.append(f"mpich=={_mpich.split('.')[0]}.*")

# cffi compiles the core against the limited C API (an `.abi3.so`), so the wheel is tagged abi3:
# one wheel serves every CPython from 3.9 on.
setup(cffi_modules=["cbridge/build_mgrit.py:ffibuilder"],
      install_requires=REQUIRES,
      options={"bdist_wheel": {"py_limited_api": "cp39"}})
