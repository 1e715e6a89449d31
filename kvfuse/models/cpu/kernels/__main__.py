"""``python -m kvfuse.models.cpu.kernels``: build the CPU kernels now (exit 1 if they cannot be built)."""

import logging
import sys

from . import get

logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.exit(0 if get() is not None else 1)
