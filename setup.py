from setuptools import setup

setup(cffi_modules=["cbridge/build_mgrit.py:ffibuilder"])
