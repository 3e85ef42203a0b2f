"""mar_probe: probe, measure and accelerate masked autoregressive (MAR) image generators.

The names below are imported on first use (PEP 562), so that importing a light part of the package (the store
reader that dask workers unpickle, the analysis) does not import torch and the models, which every worker of
``analyze --workers N`` otherwise loads (issue 16; its memory per worker: benchmarks/results/dask_analyze.md).
"""
import importlib

from ._version import __version__

_EXPORTS = {"SampleResult": "api", "decode_images": "api", "sample": "api", "MAR": "models", "MARConfig": "models",
            "PRESETS": "models", "preset_config": "models", "create_model": "models.checkpoints",
            "load_model": "models.checkpoints", "SelectionSpec": "probe", "record": "probe", "open_run": "store"}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:  # a subpackage used as an attribute (mar_probe.strategies.create) before anyone imported it
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":  # the submodule exists but needs a missing package: say that
                raise
            raise AttributeError(f"module 'mar_probe' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
