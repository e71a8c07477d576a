"""Builds the optional C id packer (kvstate.kernels.idpack); everything else is in pyproject.toml.

The extension is optional: where no C compiler is found the install goes on without it, and
kvstate.kernels.plan packs block ids in Python instead (same results, slower).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstate.kernels.idpack", ["kvstate/kernels/idpack.c"], optional=True)])
