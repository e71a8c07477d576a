"""Builds the optional C helpers; everything else is in pyproject.toml.

- kvstate.kernels.idpack packs and checks block ids (without it, kvstate.kernels.ids does it in
  Python: same results, slower);
- kvstate.backends.streamcopy copies large host buffers with streaming stores (without it,
  kvstate.backends.hostcopy copies with numpy: same bytes, slower on hosts where it matters).

Both are optional: where no C compiler is found the install goes on without them.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstate.kernels.idpack", ["kvstate/kernels/idpack.c"], optional=True),
                   Extension("kvstate.backends.streamcopy", ["kvstate/backends/streamcopy.c"], optional=True)])
