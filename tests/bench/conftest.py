"""The bench scripts (``bench/``, not a package: each runs as a script) are imported by their
module names, as they import one another: this puts ``bench/`` on ``sys.path`` once, for every
test in this folder and the processes they spawn (``run_ranks`` passes ``sys.path`` on)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
