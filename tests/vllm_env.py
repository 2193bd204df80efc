"""The vLLM environment the scorer tests start a real server from (`make vllm-env`, or $BLOCKGEN_VLLM_PYTHON)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> str:
    """Its python; without it a test is skipped, except in CI, where `make test` builds it first."""
    python = os.environ.get("BLOCKGEN_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        if os.environ.get("CI"):
            pytest.fail("CI: the vLLM environment is missing (make vllm-env)")
        pytest.skip("no vLLM environment (make vllm-env, or set BLOCKGEN_VLLM_PYTHON)")
    return python
