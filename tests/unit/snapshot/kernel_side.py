"""The in-sandbox snapshot package (``kernel-image/kernelhub_kernel/snapshot/``), loaded
from its files under a name of its own: it never imports kernelhub, and its pure parts
are tested here like ours."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "kernel-image" / "kernelhub_kernel" / "snapshot"
NAME = "kernelhub_kernel_snapshot_under_test"


def load() -> types.ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(
        NAME, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module
