"""Marks shared by the test files."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _gpu() -> bool:
    return bool(importlib.util.find_spec("torch")) and __import__("torch").cuda.is_available()


# tests whose cuda backend runs minutes in Triton's interpreter on the 2-core CI machine: on a GPU,
# or where EDGELLM_SLOW_TESTS is set
ON_GPU_OR_SLOW = pytest.mark.skipif(not (os.environ.get("EDGELLM_SLOW_TESTS") or _gpu()),
                                    reason="on a GPU; in Triton's interpreter it takes minutes (EDGELLM_SLOW_TESTS=1)")
