"""Shared pieces of the frozen config dataclasses (``to_dict``/``from_dict`` round trips)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping


def checked_fields(cls: type, data: Mapping) -> dict:
    """Check that ``data`` names only fields of the dataclass ``cls``; return it as a plain dict.

    Every config's ``from_dict`` starts here, so a typo in a saved or hand-written config fails
    with the same message everywhere instead of a ``TypeError`` from the constructor.

    Parameters
    ----------
    cls : type
        A dataclass (normally the config class whose ``from_dict`` is running).
    data : Mapping
        Field names to values, such as the output of the class's ``to_dict``.

    Returns
    -------
    dict
        A shallow copy of ``data``, safe for the caller to convert values in before ``cls(**...)``.

    Raises
    ------
    TypeError
        If ``data`` is not a mapping.
    ValueError
        If ``data`` has keys that are not fields of ``cls``; the message names them and lists the valid fields.
    """
    name = cls.__name__
    if not isinstance(data, Mapping):
        raise TypeError(f"{name}.from_dict expects a mapping of field names to values, got {type(data).__name__!r}")
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(data) - set(known), key=repr)
    if unknown:
        raise ValueError(f"unknown {name} field(s) {unknown!r}; expected a subset of {known!r}")
    return dict(data)


def check_ints(owner: str, obj, limits) -> None:
    """Raise ValueError unless every named field of ``obj`` is an integer (not a bool) at or above its limit.

    Parameters
    ----------
    owner : str
        The name the message starts with (e.g. ``"lazymar"``).
    obj : object
        The config whose fields are checked.
    limits : iterable of (str, int)
        Field name and smallest allowed value; 1 reads "a positive integer", others "an integer >= low".
    """
    for name, low in limits:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            kind = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise ValueError(f"{owner} {name} must be {kind}, got {value!r}")
