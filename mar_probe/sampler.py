"""Moved to :mod:`mar_probe.engine.loop` (the engine holds the sampling loop's contract; issue 18): kept for old
imports."""
from .engine.loop import *  # noqa: F401,F403
from .engine.loop import __all__  # noqa: F401
