"""bench/ is a directory of scripts that import each other by bare name; its pure parts
are tested here with bench/ on the path, as the scripts run."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
