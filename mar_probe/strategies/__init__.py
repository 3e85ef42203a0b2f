"""Caching strategies and their registry.

``register(name)`` decorates a factory (a Strategy subclass or a function returning one); ``create(name,
**params)`` builds one with clear errors for unknown names and parameters; ``options(name)`` lists a strategy's
options with their types and defaults, and ``parse_options`` turns ``KEY=VALUE`` strings (the CLI's) into them.
A strategy class with a ``Config`` attribute (a frozen keyword-only dataclass) takes exactly its fields.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing

from ..engine.strategy import FullStrategy, StepPlan, Strategy, Timer

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


def options(name: str) -> dict[str, tuple[str, object]]:
    """Options of a registered strategy: ``{option: (type name, default)}``."""
    factory = _factory(name)
    cfg = getattr(factory, "Config", None)
    if cfg is not None and dataclasses.is_dataclass(cfg):
        hints = typing.get_type_hints(cfg)
        return {f.name: (_type_name(hints[f.name]), _default(f)) for f in dataclasses.fields(cfg)}
    out = {}
    for p in inspect.signature(factory).parameters.values():
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else "object"
        out[p.name] = (str(ann), None if p.default is inspect.Parameter.empty else p.default)
    return out


def _default(field: dataclasses.Field):
    """A config field's default, made by its factory where it has one (``compose``'s ``token_opts``: ``{}``), so
    that listings show a value, not dataclasses' MISSING sentinel."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def describe(name: str) -> str:
    """One line per option: ``name: type = default``."""
    opts = options(name)
    return ", ".join(f"{k}: {t} = {d!r}" for k, (t, d) in opts.items()) or "(no options)"


def create(name: str, **params) -> Strategy:
    """Build a registered strategy with keyword parameters."""
    factory = _factory(name)
    opts = options(name)
    unknown = sorted(set(params) - set(opts))
    if unknown:
        raise ValueError(f"strategy {name!r} has no option(s) {unknown!r}; valid options: {describe(name)}")
    return factory(**params)


def parse_options(name: str, pairs) -> dict:
    """``["budget=32", "selection=random"]`` -> typed keyword options of strategy ``name``."""
    opts = options(name)
    out = {}
    for pair in pairs:
        key, sep, text = str(pair).partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"strategy option {pair!r} is not KEY=VALUE; valid options: {describe(name)}")
        if key not in opts:
            raise ValueError(f"strategy {name!r} has no option {key!r}; valid options: {describe(name)}")
        out[key] = _convert(key, opts[key][0], text.strip())
    return out


def _factory(name: str):
    if name not in _REGISTRY:
        listing = "; ".join(f"{n} ({describe(n)})" for n in available())
        raise ValueError(f"unknown strategy {name!r}; expected one of {available()!r}: {listing}")
    return _REGISTRY[name]


def _type_name(tp) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _convert(key: str, type_name: str, text: str):
    try:
        if type_name == "bool":
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        if type_name.startswith("tuple"):
            inner = float if "float" in type_name else int if "int" in type_name else str
            return tuple(inner(x) for x in text.split(",") if x.strip())
        if "None" in type_name and text.lower() == "none":
            return None
        for tp in (int, float):
            if type_name.startswith(tp.__name__):
                return tp(text)
        return text
    except ValueError:
        raise ValueError(f"option {key!r} expects {type_name}, got {text!r}") from None


register("full")(FullStrategy)

from . import adaptive, compose, disa, fewer_steps, lazymar, lazymar_disa, marche, recap  # noqa: E402,F401  (register the built-in strategies)

__all__ = ["FullStrategy", "StepPlan", "Strategy", "Timer", "available", "create", "describe", "options",
           "parse_options", "register"]
