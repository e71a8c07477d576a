"""The SimPy simulator (issue: "SimPy simulator"). Not implemented yet: importing it
exports nothing, so no unfinished API can be mistaken for a working one."""
__all__: list[str] = []
