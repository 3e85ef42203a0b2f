"""Moved to :mod:`mar_probe.engine.strategy` (strategies depend on the engine, not the reverse; issue 18): kept
for old imports."""
from ..engine.strategy import *  # noqa: F401,F403
from ..engine.strategy import __all__  # noqa: F401
