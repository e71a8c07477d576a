"""The code's own rules, checked with the suite: lint (ruff, complexity included), types (mypy,
strict on the core), module and function size limits, and commit subject lengths."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import has_module

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kvstate", "tests", "benchmarks", "examples")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_SUBJECT = 400, 60, 72
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


def test_modules_and_functions_stay_small():
    too_big = []
    for path in _python_files():
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
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
