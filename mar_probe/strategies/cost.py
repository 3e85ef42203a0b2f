"""Moved to :mod:`mar_probe.engine.cost` (issue 18): kept for old imports."""
from ..engine.cost import *  # noqa: F401,F403
from ..engine.cost import __all__  # noqa: F401
