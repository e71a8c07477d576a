"""What a test needs that a machine may lack, in one place: the reason it is skipped with.

``gpu(*modules)`` marks a test that needs CuPy, a CUDA device and ``modules``; ``mooncake``
marks one that needs the Mooncake transfer engine. Each is a ``skipif`` carrying the reason, so
a test runs for real where the thing is present and says why it did not where it is not.
"""
from __future__ import annotations

import functools
import importlib.util

import pytest

__all__ = ["has_module", "gpu_missing", "gpu", "mooncake_missing", "vllm_missing"]


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here (the package, or a library it loads), or None."""
    if not has_module("mooncake"):
        return "mooncake-transfer-engine is not installed (pip install '.[mooncake]')"
    from kvstate import StoreError
    from kvstate.backends._mooncake import load_mooncake

    try:
        load_mooncake()
    except StoreError as e:
        return str(e)
    return None


@functools.cache
def vllm_missing() -> str | None:
    """Why vLLM's scheduler cannot run here, or None (pip install '.[vllm]': the CPU build)."""
    if not has_module("vllm") or not has_module("torch"):
        return "vllm is not installed (pip install '.[vllm]', then remove torchvision, torchaudio, torchcodec)"
    try:
        importlib.import_module("vllm.v1.core.sched.scheduler")
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to skip
        return f"vllm does not import here: {type(e).__name__}: {e}"
    return None


@functools.cache
def _cuda() -> bool:
    from kvstate.kernels._cuda import cuda_available

    return cuda_available()


def gpu_missing(*modules: str) -> str | None:
    """Why a GPU test needing CuPy, a CUDA device and ``modules`` cannot run here, or None."""
    lacking = [m for m in ("cupy", *modules) if not has_module(m)]
    if lacking:
        return f"needs {', '.join(lacking)} and a CUDA device"
    return None if _cuda() else "needs a CUDA device (CuPy sees none)"


def gpu(*modules: str) -> pytest.MarkDecorator:
    """Skip, with the reason, unless CuPy, a CUDA device and ``modules`` are here."""
    why = gpu_missing(*modules)
    return pytest.mark.skipif(why is not None, reason=why or "")
