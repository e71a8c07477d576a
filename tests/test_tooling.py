"""The code's own rules, checked with the suite: lint (ruff, complexity included), types (mypy,
strict on the core), module and function size limits, and commit subject lengths."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from needs import has_module

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kvstate", "tests", "benchmarks", "examples")
#: a module past MAX_MODULE_LINES is looked at again (one concept?), never split to fit the count
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_SUBJECT = 600, 60, 72
#: the subject rule applies to the commits after this one (older history predates it)
SUBJECTS_FROM = "e08c45c"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None and not has_module("ruff"), reason="needs ruff (the test extra)")
def test_ruff_finds_nothing():
    r = _run(sys.executable, "-m", "ruff", "check", *CODE)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not has_module("mypy"), reason="needs mypy (the test extra)")
def test_mypy_finds_nothing():
    r = _run(sys.executable, "-m", "mypy")  # configured in pyproject.toml: the package, the core strict
    assert r.returncode == 0, r.stdout + r.stderr


def _python_files() -> list[Path]:
    return sorted(p for d in CODE for p in (ROOT / d).rglob("*.py"))


#: modules looked at again past MAX_MODULE_LINES and kept whole: each holds one concept
ONE_CONCEPT: dict[str, str] = {
    "kvstate/sim/_scenario.py": "the scenario schema: every section, its fields and its rules, read in one place",
    "kvstate/backends/_cuda.py": "the CUDA backend's transfers: the staged and the zero-copy paths share its bound "
                                 "caches, streams, locks and checksums",
    "kvstate/backends/_arena.py": "the arena store: its file, slot index, claims, puts and gets, under one lock "
                                  "whose crash rules its docstring states",
}


def test_modules_and_functions_stay_small():
    """Functions stay under MAX_FUNCTION_LINES; a module past MAX_MODULE_LINES is looked at
    again, and kept whole (listed in ONE_CONCEPT with its concept) when it holds one idea."""
    too_big = []
    for path in _python_files():
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES and str(name) not in ONE_CONCEPT:
            too_big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    assert not too_big, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {too_big}"


def test_commit_subjects_are_short():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    r = _run("git", "log", "--format=%h %s", f"{SUBJECTS_FROM}..HEAD")
    if r.returncode != 0:
        pytest.skip(f"history not available here (shallow clone?): {r.stderr.strip()}")
    long = [line for line in r.stdout.splitlines() if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, f"subjects over {MAX_SUBJECT} characters: {long}"


def _imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The kvstate modules ``module`` imports (``TYPE_CHECKING`` imports too: a circle of types
    is a circle of ideas). ``from . import x`` names module ``x`` when there is one (a C
    extension counts: its source sits beside), else the package."""
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg if node.level else ""
            target = ".".join(x for x in (base, node.module or "") if x)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known or (node.level and (path.parent / f"{a.name}.c").exists()):
                    out.add(sub)
                elif target in known:
                    out.add(target)
    return out - {module}


def test_no_import_circles():
    """No module of kvstate imports, through any chain, a module that imports it back."""
    known = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "kvstate").rglob("*.py")}
    graph = {m: _imports(p, m, known) & set(known) for m, p in known.items()}
    circles = []
    for start in graph:  # a path back to ``start`` from what it imports
        seen, stack = set(), [(n, [start, n]) for n in graph[start]]
        while stack:
            node, path = stack.pop()
            if node == start:
                circles.append(" -> ".join(path))
                break
            if node not in seen:
                seen.add(node)
                stack += [(n, [*path, n]) for n in graph.get(node, ())]
    assert not circles, f"import circles: {circles[:5]}"


def test_the_core_knows_no_gpu_simpy_socket_or_process():
    """kvstate's top-level modules (the lifecycle core) import no GPU, simulator, socket or
    process library, directly or through another kvstate module they import."""
    banned = ("cupy", "torch", "paddle", "simpy", "zmq", "socket", "subprocess", "multiprocessing", "msgpack")
    core = [p for p in (ROOT / "kvstate").glob("*.py") if p.name != "__main__.py"]  # the command's entry
    found = []
    for p in core:
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{p.name}: {n}" for n in names if n.split(".")[0] in banned]
            if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").split(".")[0] in \
                    ("backends", "kernels", "sim", "app", "distributed"):
                found.append(f"{p.name}: .{node.module}")
    assert not found, f"the core imports the edge: {found}"


#: the most kvstate classes one class's method resolution may run through (itself included)
MAX_KVSTATE_MRO = 4


def test_classes_compose_rather_than_stack_mixins():
    """No kvstate class inherits through more than MAX_KVSTATE_MRO kvstate classes (a part is
    held, not mixed in), and no method raises NotImplementedError (an abstract base says
    ``abstractmethod`` instead, so a missing method fails at construction, not mid-transfer)."""
    import importlib
    import inspect
    import pkgutil

    import kvstate
    deep, stubs = [], []
    for info in pkgutil.walk_packages(kvstate.__path__, "kvstate."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for name, cls in vars(mod).items():
            if inspect.isclass(cls) and cls.__module__ == mod.__name__:
                mine = [c.__name__ for c in cls.__mro__ if c.__module__.startswith("kvstate")]
                if len(mine) > MAX_KVSTATE_MRO:
                    deep.append(f"{info.name}.{name}: {' -> '.join(mine)}")
        source = Path(mod.__file__ or "")
        for node in ast.walk(ast.parse(source.read_text())) if source.suffix == ".py" else ():
            if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node.exc or node):
                stubs.append(f"{info.name}:{node.lineno}")
    assert not deep, f"classes stacked past {MAX_KVSTATE_MRO} kvstate classes: {deep}"
    assert not stubs, f"methods that raise NotImplementedError: {stubs}"
