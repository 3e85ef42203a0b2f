"""What a recording captures: the :class:`SelectionSpec` and its resolution against a model and a run.

The activation variables are declared in :mod:`~mar_probe.store.variables` (their hooks, dims and derivation):
``{stack}_{quantity}`` (``enc_k``, ``dec_resid_post``), plus ``z`` (decoder output fed to the head), ``z_cfg_resid``
(``z_cond - z_uncond``) and ``attn_gen`` (MARché's selection score: the head-averaged attention that the generating
tokens pay to every token, per decoder layer). Bookkeeping variables (:data:`BOOKKEEPING`) are always recorded.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .._config import checked_fields
from ..vocab import BRANCHES, PREFIXES
from .variables import STACK_QUANTITIES, VARIABLES

__all__ = ["ACTIVATIONS", "BOOKKEEPING", "BRANCHES", "DEFAULT_VARIABLES", "DTYPES", "STACK_QUANTITIES", "SelectionSpec",
           "parse_index_list"]

ACTIVATIONS = tuple(VARIABLES)
BOOKKEEPING = ("mask", "pred", "cfg", "order", "tokens", "images")
DEFAULT_VARIABLES = tuple(f"{s}_{q}" for s in PREFIXES for q in ("q", "k", "v", "resid_post")) + (
    "z", "z_cfg_resid", "attn_gen")
DTYPES = ("float16", "float32", "bfloat16")


def _as_int_tuple(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_index_list(value, name)
    out = tuple(value)
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"SelectionSpec.{name} must hold non-negative integers, got {v!r} in {out!r}")
    if len(set(out)) != len(out) or not out:
        raise ValueError(f"SelectionSpec.{name} must be a non-empty list without duplicates, got {out!r}")
    return tuple(sorted(out))


def parse_index_list(text: str, what: str = "indices") -> tuple[int, ...]:
    """Parse "0,2,5-7" (inclusive ranges) into (0, 2, 5, 6, 7)."""
    out = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers or ranges like '0-3', got {text!r}") from None
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class SelectionSpec:
    """Which variables, layers, steps, samples and CFG branches a recording stores, and in what dtype.

    Parameters
    ----------
    variables : tuple of str
        Activation variables (see :data:`ACTIVATIONS`); bookkeeping (:data:`BOOKKEEPING`) is always stored.
    layers, steps, samples : tuple of int, optional
        Indices to keep (None: all). Layers apply to both stacks.
    branches : tuple of str, optional
        CFG branches to keep, a subset of ("cond", "uncond") (None: all the run has).
    dtype : {"float16", "float32", "bfloat16"}
        Storage dtype of activations; bfloat16 is stored losslessly as its uint16 bit pattern.
    """
    variables: tuple[str, ...] = DEFAULT_VARIABLES
    layers: tuple[int, ...] | None = None
    steps: tuple[int, ...] | None = None
    samples: tuple[int, ...] | None = None
    branches: tuple[str, ...] | None = None
    dtype: str = "float16"

    def __post_init__(self):
        names = (self.variables,) if isinstance(self.variables, str) else self.variables
        names = tuple(n.strip() for v in names for n in str(v).split(",") if n.strip())
        unknown = [n for n in names if n not in VARIABLES and n not in BOOKKEEPING]
        if unknown:
            raise ValueError(f"unknown variable(s) {unknown!r}; expected some of {tuple(VARIABLES)!r} "
                             f"(always recorded: {BOOKKEEPING!r})")
        object.__setattr__(self, "variables", tuple(n for n in dict.fromkeys(names) if n in VARIABLES))
        for f in ("layers", "steps", "samples"):
            object.__setattr__(self, f, _as_int_tuple(f, getattr(self, f)))
        if self.branches is not None:
            br = (self.branches,) if isinstance(self.branches, str) else tuple(self.branches)
            br = tuple(b.strip() for v in br for b in v.split(",") if b.strip())
            if not br or any(b not in BRANCHES for b in br):
                raise ValueError(f"SelectionSpec.branches must be a non-empty subset of {BRANCHES!r}, got {br!r}")
            object.__setattr__(self, "branches", tuple(b for b in BRANCHES if b in br))
        if self.dtype not in DTYPES:
            raise ValueError(f"SelectionSpec.dtype must be one of {DTYPES!r}, got {self.dtype!r}")

    def to_dict(self) -> dict:
        """Plain JSON-able dict (lists for tuples)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> SelectionSpec:
        """Build from a dict such as :meth:`to_dict`'s, with a clear error for unknown keys."""
        return cls(**{k: v for k, v in checked_fields(cls, data).items() if v is not None})

    @classmethod
    def from_file(cls, path: str | Path) -> SelectionSpec:
        """Read a YAML (.yaml/.yml) or JSON file holding the fields of :meth:`to_dict`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"selection spec {str(path)!r} not found; expected a YAML or JSON file")
        text = path.read_text()
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml
                data = yaml.safe_load(text) or {}
            else:
                data = json.loads(text)
        except ValueError as exc:  # json.JSONDecodeError
            raise ValueError(f"selection spec {str(path)!r} is not valid JSON: {exc}") from None
        except Exception as exc:  # yaml.YAMLError (yaml is imported lazily)
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"selection spec {str(path)!r} is not valid YAML{where}: "
                             f"{getattr(exc, 'problem', None) or exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"selection spec {str(path)!r} must hold a mapping, got {type(data).__name__!r}")
        return cls.from_dict(data)

    def replace(self, **changes) -> SelectionSpec:
        return dataclasses.replace(self, **changes)
