"""Interactive explorers of recorded runs and strategy comparisons (ipywidgets + matplotlib, no custom JS).

Both work on data recorded earlier, without the model loaded: :func:`explore` on a run store,
:func:`compare_strategies` on strategy results. Figures are drawn off-screen with Agg and shown as PNG in an
``ipywidgets.Image``, so they render the same in JupyterLab, VS Code and headless tests. Needs ``ipywidgets``
(``pip install -e '.[notebooks]'``).
"""
from .compare import StrategyComparison, compare_strategies
from .explorer import Explorer, explore
from .results import StrategyEntry, load_results

__all__ = ["Explorer", "StrategyComparison", "StrategyEntry", "compare_strategies", "explore", "load_results"]
