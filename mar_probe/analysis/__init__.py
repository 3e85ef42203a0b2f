"""Measurements of redundancy in MAR decoding from a recorded run (lazy, chunk by chunk).

Every function takes xarray objects as returned by :func:`mar_probe.store.open_run` and returns lazy
(dask-backed) results; nothing loads a whole variable. Layers and steps are the store's 0-based coordinates
(the papers count layers from 1: MARché's "Layer 2" is ``layer=1``). Importing this package registers the
``ds.probe`` accessor.
"""
from . import accessor  # noqa: F401  (registers ds.probe)
from ._checks import check_values, require
from .categories import CATEGORIES, category_masks, token_categories
from .claims import cfg_residual_ratio, cfg_residual_ratio_per_sample, skippable_fraction, skippable_sweep
from .cluster import SchedulerError, dask_cluster
from .cfg import adjacent_mse, cfg_residual_mse
from .overlap import topk_overlap_layers, topk_overlap_steps
from .runs import combine_runs, open_runs, stream_chunks
from .selection import (CANDIDATES, attention_selector, lazymar_selector, selection_vs_drift, set_overlap,
                        topk_rank)
from .stability import THRESHOLDS, cosine_stability, drift, step_pairs, summarize_stability
from .stats import aggregate
from .summary import format_summary, headlines, run_summary, summary_json

__all__ = ["CANDIDATES", "CATEGORIES", "SchedulerError", "THRESHOLDS", "adjacent_mse", "aggregate",
           "attention_selector", "category_masks", "cfg_residual_mse", "cfg_residual_ratio",
           "cfg_residual_ratio_per_sample", "check_values", "combine_runs",
           "cosine_stability", "dask_cluster", "drift", "format_summary", "headlines", "lazymar_selector", "open_runs",
           "require", "run_summary", "selection_vs_drift", "set_overlap", "skippable_fraction", "skippable_sweep",
           "step_pairs", "stream_chunks",
           "summarize_stability", "summary_json", "token_categories", "topk_overlap_layers", "topk_overlap_steps",
           "topk_rank"]
