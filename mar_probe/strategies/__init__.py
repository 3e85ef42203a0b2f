"""Caching strategies and their registry.

``register(name)`` decorates a factory (a Strategy subclass or a function returning one); ``create(name,
**params)`` builds one with clear errors for unknown names and parameters.
"""
from __future__ import annotations

import inspect

from .base import FullStrategy, Strategy, Timer

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator adding a strategy factory to the registry under ``name``."""
    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory
    return deco


def available() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_REGISTRY)


def create(name: str, **params) -> Strategy:
    """Build a registered strategy with keyword parameters."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; expected one of {available()!r}")
    factory = _REGISTRY[name]
    accepted = set(inspect.signature(factory).parameters)
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"strategy {name!r} has no parameter(s) {unknown!r}; expected some of {sorted(accepted)!r}")
    return factory(**params)


register("full")(FullStrategy)

__all__ = ["FullStrategy", "Strategy", "Timer", "available", "create", "register"]
