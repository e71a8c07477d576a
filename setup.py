"""Builds the optional C helpers; everything else is in pyproject.toml.

- kvstate.kernels._idpack packs and checks block ids (without it, kvstate.kernels._ids does it in
  Python: same results, slower);
- kvstate.backends._streamcopy copies large host buffers with streaming stores (without it,
  kvstate.backends._hostcopy copies with numpy: same bytes, slower on hosts where it matters).

Both are optional: where no C compiler is found the install goes on without them.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstate.kernels._idpack", ["kvstate/kernels/_idpack.c"], optional=True),
                   Extension("kvstate.backends._streamcopy", ["kvstate/backends/_streamcopy.c"], optional=True)])
