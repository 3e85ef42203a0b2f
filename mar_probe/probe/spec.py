"""Moved to :mod:`mar_probe.store.spec` (the store declares what it can hold; issue 18): kept for old imports."""
from ..store.spec import *  # noqa: F401,F403
from ..store.spec import __all__  # noqa: F401
