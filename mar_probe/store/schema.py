"""The store schema: dimensions, variables, chunks and coordinates of a recorded run.

Dimensions come in the fixed order ``sample, step, branch, layer, token, head, d_head`` (then ``d_model``,
``channel``, ``y, x, color``). The ``token`` axis is the full ``[buffer; image tokens]`` sequence of length
S + L (coordinates ``row``/``col`` are -1 on buffer rows), so encoder variables, which see only the known
tokens, are scattered back onto it with NaN where a token was not processed. When the encoder and the decoder
differ in depth, heads or width, the differing dimensions get a stack prefix (``enc_layer``, ``dec_head``).
Beside the activations, ``enc_computed``/``dec_computed`` [sample, step, branch, layer, token] say which rows each
layer computed and ``derived`` [sample, step, branch] which CFG branches a strategy derived instead of computing
(schema version 2; version-1 stores predate them and hold only fully computed steps).
Per-step variables are chunked one chunk per (sample, block of ``steps_per_chunk`` steps), per-sample ones one
chunk per sample, so every chunk is written exactly once by one writer. Chunk keys are flat (``c.0.3.0...``,
separator ``.``), so a chunk is one file in its variable's folder rather than a fresh chain of nested folders.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..vocab import BRANCHES, PREFIXES  # PREFIXES: ("enc", "dec")
from .variables import DIMS_PER_STACK, VARIABLES

if TYPE_CHECKING:
    from .spec import SelectionSpec

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 had no enc_computed/dec_computed/derived: every row was computed
DIM_ORDER = ("sample", "step", "branch", "layer", "token", "head", "d_head", "d_model", "channel", "y", "x", "color")
BF16_NAN = 0x7FC0
COMPUTED_DOC = ("True where the layer computed the row's q/k/v at this step for this branch; False where the row was "
                "not processed (encoder: unknown tokens), served from a strategy's cache, or the branch was derived")
CHUNK_TARGET_BYTES = 4 << 20  # automatic steps_per_chunk: the largest chunk of any variable stays within this
DERIVED_DOC = "True where the strategy derived this CFG branch instead of computing it (its z is the derived value)"


@dataclass(frozen=True)
class StackDims:
    depth: int
    heads: int
    d_head: int
    d_model: int


@dataclass(frozen=True)
class ModelDims:
    """Sizes the schema needs, read from module attributes (works on official MAR instances too)."""
    buffer: int
    seq_len: int
    grid: int
    channels: int
    enc: StackDims
    dec: StackDims

    @classmethod
    def from_model(cls, model) -> ModelDims:
        def stack(blocks):
            attn = blocks[0].attn
            width = attn.qkv.in_features
            return StackDims(len(blocks), attn.num_heads, width // attn.num_heads, width)
        return cls(model.buffer_size, model.seq_len, int(round(model.seq_len ** 0.5)), model.token_embed_dim,
                   stack(model.encoder_blocks), stack(model.decoder_blocks))

    @property
    def tokens(self) -> int:
        return self.buffer + self.seq_len


@dataclass(frozen=True)
class VarLayout:
    """One stored variable: named dims, shape, chunks, numpy storage dtype, fill value and attrs."""
    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    fill: object
    per_step: bool
    attrs: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def step_nbytes(self) -> int:
        """Bytes of one sample's step (per-step variables; a chunk holds ``steps_per_chunk`` of them)."""
        return self.nbytes // (self.shape[0] * self.shape[1])


@dataclass(frozen=True)
class RunLayout:
    """A selection resolved against a model and a run: concrete indices and every variable's layout."""
    samples: tuple[int, ...]
    steps: tuple[int, ...]
    branches: tuple[str, ...]
    run_branches: tuple[str, ...]
    layers: dict
    dims: ModelDims
    spec: SelectionSpec
    variables: dict
    sizes: dict
    steps_per_chunk: int = 1

    def step_index(self, step: int) -> int | None:
        """Position of sampler step ``step`` on the store's step axis (None when not selected)."""
        return self._step_pos.get(step)

    def __post_init__(self):
        object.__setattr__(self, "_step_pos", {s: i for i, s in enumerate(self.steps)})


def _check_subset(what: str, chosen, limit: int, hint: str) -> tuple[int, ...]:
    bad = [i for i in chosen if i >= limit]
    if bad:
        raise ValueError(f"{what} {bad!r} out of range: expected indices in 0..{limit - 1} ({hint})")
    return tuple(chosen)


def stack_used(spec: SelectionSpec, stack: str) -> bool:
    """Whether ``spec`` records a per-layer variable of ``stack`` (``enc``/``dec``)."""
    return any(VARIABLES[v].layered and VARIABLES[v].stack == stack for v in spec.variables)


def _resolve_layers(spec: SelectionSpec, dims: ModelDims) -> dict:
    layers = {}
    for s in PREFIXES:
        depth = getattr(dims, s).depth
        used = stack_used(spec, s)
        chosen = spec.layers if spec.layers is not None else tuple(range(depth))
        if used:
            _check_subset(f"{s} layer(s)", chosen, depth, f"the model has {depth} {s}oder blocks")
        layers[s] = tuple(i for i in chosen if i < depth)
    return layers


def _dim_names(layers: dict, dims: ModelDims) -> dict:
    """Per-stack dimension names: shared when both stacks agree, stack-prefixed otherwise."""
    same = {"layer": layers["enc"] == layers["dec"], "head": dims.enc.heads == dims.dec.heads,
            "d_head": dims.enc.d_head == dims.dec.d_head, "d_model": dims.enc.d_model == dims.dec.d_model}
    return {s: {k: (k if ok else f"{s}_{k}") for k, ok in same.items()} for s in PREFIXES}


def resolve(spec: SelectionSpec, model_or_dims, *, num_samples: int, num_iter: int, cfg: float,
            images: tuple[int, int, int] | None = None, steps_per_chunk: int | None = None) -> RunLayout:
    """Resolve ``spec`` for a run, with clear errors for out-of-range layers, steps, samples or branches.

    ``steps_per_chunk`` sets how many steps one chunk of a per-step variable holds (None: :func:`auto_steps_per_chunk`).
    """
    dims = model_or_dims if isinstance(model_or_dims, ModelDims) else ModelDims.from_model(model_or_dims)
    samples = _check_subset("sample(s)", spec.samples or range(num_samples), num_samples,
                            f"the run has {num_samples} samples")
    steps = _check_subset("step(s)", spec.steps or range(num_iter), num_iter, f"the run has {num_iter} steps")
    run_branches = BRANCHES if cfg != 1.0 else BRANCHES[:1]
    branches = spec.branches or run_branches
    if any(b not in run_branches for b in branches):
        raise ValueError(f"branch(es) {branches!r} not in this run: cfg={cfg!r} gives branches {run_branches!r}")
    both = [v for v in spec.variables if VARIABLES[v].needs_both_branches]
    if both and len(run_branches) < 2:
        raise ValueError(f"{', '.join(both)} needs both CFG branches; expected cfg != 1, got cfg={cfg!r}")
    layers = _resolve_layers(spec, dims)
    sizes = dict(sample=len(samples), step=len(steps), branch=len(branches), token=dims.tokens,
                 channel=dims.channels)
    variables = _variables(spec, dims, layers, sizes, images)
    block = _check_steps_per_chunk(steps_per_chunk, len(steps)) or auto_steps_per_chunk(variables, len(steps))
    variables = {k: replace(v, chunks=(1, block) + v.chunks[2:]) if v.per_step else v for k, v in variables.items()}
    return RunLayout(samples, steps, branches, run_branches, layers, dims, spec, variables, sizes, block)


def _check_steps_per_chunk(value, num_steps: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value:
        raise ValueError(f"steps_per_chunk must be an integer >= 1 (or None for automatic), got {value!r}")
    return min(value, num_steps)


def auto_steps_per_chunk(variables: dict, num_steps: int, target: int = CHUNK_TARGET_BYTES) -> int:
    """Steps per chunk: the largest power of two (at most ``num_steps``) whose chunks stay within ``target`` bytes.

    Each chunk is a file with a fixed cost to write (about a millisecond of Python and file-system work), so
    small per-step chunks make recording CPU-bound; large ones cost memory, as a chunk is assembled before it
    is written. A variable whose one step already exceeds ``target`` gives one step per chunk.
    """
    step_bytes = max(v.step_nbytes for v in variables.values() if v.per_step)
    block = 1
    while block * 2 <= num_steps and block * 2 * step_bytes <= target:
        block *= 2
    return block


def _activation_dtype(spec: SelectionSpec):
    if spec.dtype == "bfloat16":
        return "uint16", BF16_NAN, {"mar_probe_dtype": "bfloat16"}
    return spec.dtype, np.nan, {}


def _activation_dims(name: str, dims: ModelDims, names: dict) -> list[tuple[str, int | None]]:
    """The declared dims of variable ``name`` after (sample, step), named for this store, with their sizes (None:
    the run's, from the resolved ``sizes``: branch and layer)."""
    var = VARIABLES[name]
    st = getattr(dims, var.stack)
    size = {"token": dims.tokens, "head": st.heads, "d_head": st.d_head, "d_model": st.d_model}
    return [(names[var.stack][d] if d in DIMS_PER_STACK else d, size.get(d)) for d in var.dims]


def _variables(spec, dims: ModelDims, layers: dict, sizes: dict, images) -> dict:
    names = _dim_names(layers, dims)
    for s in PREFIXES:
        sizes[names[s]["layer"]] = len(layers[s])
    out = {}
    dtype, fill, attrs = _activation_dtype(spec)
    for v in spec.variables:
        rest = [(d, n if n is not None else sizes[d]) for d, n in _activation_dims(v, dims, names)]
        out[v] = _var(v, ["sample", "step"] + [d for d, _ in rest], sizes, tail=[n for _, n in rest], dtype=dtype,
                      fill=fill, per_step=True, attrs=dict(attrs, description=VARIABLES[v].description))
    for s in PREFIXES:
        if stack_used(spec, s):
            name = f"{s}_computed"
            out[name] = _var(name, ["sample", "step", "branch", names[s]["layer"], "token"], sizes,
                             tail=[dims.tokens], dtype="bool", fill=False, per_step=True,
                             attrs={"description": COMPUTED_DOC})
    step_vars = (("mask", "bool", False, ["token"]), ("pred", "bool", False, ["token"]),
                 ("cfg", "float32", np.nan, []), ("derived", "bool", False, ["branch"]), ("done", "bool", False, []))
    for v, dt, fl, extra in step_vars:
        out[v] = _var(v, ["sample", "step"] + extra, sizes, tail=[sizes[e] for e in extra], dtype=dt, fill=fl,
                      per_step=True, attrs={"description": DERIVED_DOC} if v == "derived" else None)
    out["order"] = _var("order", ["sample", "token"], sizes, tail=[dims.tokens], dtype="int32", fill=-1)
    out["tokens"] = _var("tokens", ["sample", "token", "channel"], sizes, tail=[dims.tokens, dims.channels],
                         dtype="float32", fill=np.nan)
    if images is not None:
        out["images"] = _var("images", ["sample", "y", "x", "color"], sizes, tail=list(images), dtype="uint8", fill=0)
    out["complete"] = _var("complete", ["sample"], sizes, tail=[], dtype="bool", fill=False)
    return out


def _var(name: str, dim_names: list, sizes: dict, *, tail: list, dtype: str, fill, per_step: bool = False,
         attrs: dict | None = None) -> VarLayout:
    """A variable whose leading dims take their sizes from ``sizes`` and whose last ``len(tail)`` are ``tail``;
    one chunk per sample (and per step when ``per_step``)."""
    lead = len(dim_names) - len(tail)
    shape = tuple(sizes[d] for d in dim_names[:lead]) + tuple(tail)
    chunks = (1,) * (2 if per_step else 1) + shape[(2 if per_step else 1):]
    return VarLayout(name=name, dims=tuple(dim_names), shape=shape, chunks=chunks, dtype=dtype, fill=fill,
                     per_step=per_step, attrs=dict(attrs or {}))


def estimate_size(spec: SelectionSpec, model, num_samples: int, num_iter: int, *, cfg: float,
                  images: tuple[int, int, int] | None = None) -> dict[str, int]:
    """Uncompressed bytes each variable of a recording would take (``--dry-run``).

    Parameters
    ----------
    spec : SelectionSpec
    model : MAR or ModelDims
    num_samples, num_iter : int
        Samples of the run and MAR steps per sample.
    cfg : float
        Guidance scale: 1.0 records one branch, anything else two.
    images : (height, width, channels), optional
        Image shape when images are decoded.

    Returns
    -------
    dict
        Variable name -> bytes, in storage order.
    """
    layout = resolve(spec, model, num_samples=num_samples, num_iter=num_iter, cfg=cfg, images=images)
    return {name: var.nbytes for name, var in layout.variables.items()}


def format_bytes(n: float) -> str:
    """Human-readable byte count (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def coordinates(layout: RunLayout, labels, seeds) -> dict:
    """Coordinate arrays of a run: sample (with label, seed), step, branch, layers, token (with row, col)."""
    d = layout.dims
    seq = np.arange(d.tokens)
    img = seq - d.buffer
    row = np.where(img >= 0, img // d.grid, -1)
    col = np.where(img >= 0, img % d.grid, -1)
    samples = np.asarray(layout.samples, dtype=np.int64)
    coords = {"sample": ("sample", samples), "label": ("sample", np.asarray(labels, dtype=np.int64)[samples]),
              "seed": ("sample", np.asarray(seeds, dtype=np.int64)[samples]),
              "step": ("step", np.asarray(layout.steps, dtype=np.int64)),
              "branch": ("branch", np.array(layout.branches, dtype=object)),
              "token": ("token", seq), "row": ("token", row), "col": ("token", col)}
    for s in PREFIXES:
        name = "layer" if layout.layers["enc"] == layout.layers["dec"] else f"{s}_layer"
        coords[name] = (name, np.asarray(layout.layers[s], dtype=np.int64))
    return coords
