from setuptools import setup

# cffi compiles the core against the limited C API (an `.abi3.so`), so the wheel is tagged abi3:
# one wheel serves every CPython from 3.9 on.
setup(cffi_modules=["cbridge/build_mgrit.py:ffibuilder"],
      options={"bdist_wheel": {"py_limited_api": "cp39"}})
