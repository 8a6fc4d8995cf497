"""The in-sandbox modules (``kernel-image/kernelhub_kernel/``), loaded from their files
under names of their own: they never import kernelhub, so they run here in-process."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "kernel-image" / "kernelhub_kernel"


def load(name: str) -> types.ModuleType:
    """``kernelhub_kernel.<name>`` (a top-level module of the package: stdlib-only)."""
    key = f"kernelhub_kernel_{name}_under_test"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
