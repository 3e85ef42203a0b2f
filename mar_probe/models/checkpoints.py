"""Building models and loading checkpoints from local paths.

Official MAR checkpoints (``checkpoint-last.pth``) hold ``model``, ``model_ema`` and an argparse ``args``;
mar_probe's own add ``mar_probe_config``, so a model rebuilds from the file alone.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from .._io import atomic_path, load_weights
from .config import MARConfig
from .mar import MAR
from .presets import DEFAULT_PRESET, PRESETS, preset_config

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_CHECKPOINT = DATA_DIR / "fashion_b128.pth"


class CheckpointError(ValueError):
    """A checkpoint does not fit the model it is loaded into."""


class DeviceError(ValueError, RuntimeError):
    """A device name that torch does not know, or CUDA asked for where there is none."""


# the settings a checkpoint's "sampling_defaults" may recommend; what is left out is resolved by
# mar_probe.engine.SamplingConfig.resolve, the one place their defaults live (issue 18)
SAMPLING_KEYS = ("num_iter", "cfg", "cfg_schedule", "temperature")


def _sampling_defaults(state: dict, path) -> dict:
    found = dict(state.get("sampling_defaults") or {})
    unknown = sorted(set(found) - set(SAMPLING_KEYS))
    if unknown:
        raise CheckpointError(f"checkpoint {str(path)!r} has unknown sampling_defaults {unknown!r}; "
                              f"expected some of {SAMPLING_KEYS!r}")
    return found


def write_sampling_defaults(path: str | Path, **values) -> Path:
    """Store recommended sampling settings (e.g. ``temperature=0.7``) in a checkpoint file, atomically."""
    path = Path(path)
    state = read_checkpoint(path)
    state["sampling_defaults"] = {**_sampling_defaults(state, path), **values}
    _sampling_defaults(state, path)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def create_model(preset: str = DEFAULT_PRESET, **overrides) -> MAR:
    """Build a randomly initialised MAR from a preset name with keyword overrides."""
    return MAR(preset_config(preset, **overrides))


def create_perturbed_model(preset: str = "mar_tiny", *, seed: int = 1, scale: float = 0.05, **overrides) -> MAR:
    """A preset (``torch.manual_seed(0)`` initialisation) whose every parameter gets seeded Gaussian noise of std
    ``scale``: a fresh model's zero-initialised head and AdaLN layers make every strategy's tokens constant and
    every comparison trivially exact, so tests and smoke benchmarks use this instead."""
    torch.manual_seed(0)
    model = create_model(preset, **overrides).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device, with a clear error for CUDA on a machine without it."""
    try:
        dev = torch.device(device if device is not None else "cpu")
    except RuntimeError:  # torch's own message lists every backend it was built to name
        raise DeviceError(f"unknown device {str(device)!r}; expected 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {str(device)!r} requested but CUDA is not available on this machine; "
                          "expected 'cpu' here (or install a CUDA build of torch on a GPU machine)")
    return dev


def read_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint file with ``weights_only=True`` (argparse.Namespace allowed, nothing else)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} not found; expected a local file such as MAR's "
                                "checkpoint-last.pth or one written by `mar-probe train`")
    state = load_weights(path, what="checkpoint", error=CheckpointError, allowed=(argparse.Namespace,))
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds a {type(state).__name__!r}, expected a dict")
    return state


def pack_history(rows, *, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """A cumulative loss history ``[[iteration, loss, seconds], ...]`` (iterations 0, 1, ...) packed as two
    vectors of ``dtype``: ``loss`` and ``step_seconds`` (each iteration's own seconds: the cumulative ones'
    differences). Exports keep it beside them (:func:`write_history`) in float32; float16 was for histories kept
    inside the 25 MB file (phases 11-19 of issue 14).

    Inside the file a row cost, pickled as lists, ~27 bytes; as float32 (loss, cumulative seconds), 8 (exports of
    phases 11-13); float32 loss and float16 steps, 6 (phases 14-18, which left 9 KB after 20,388 rows); float16, 4
    (phase 19); why it then moved beside the file: :func:`write_history`. Float16 keeps a loss near 0.07 to 3e-5 (a
    relative 2^-11, rounded to nearest, so the errors of a 100-iteration mean, which the card prints to 4 decimals,
    mostly cancel), a 5 s step to 4 ms and a 40 s stall to 31 ms; as each step is rounded with what the earlier
    roundings left over, summing them back in float64 gives every cumulative second within half a step's rounding
    (steps of one length rounded alike would otherwise add up).
    """
    rows = [list(r) for r in rows]
    its = [int(r[0]) for r in rows]
    if its != list(range(len(rows))):
        raise ValueError(f"a packed loss history needs iterations 0, 1, ..., {len(rows) - 1}, got {its[:3]!r} ... "
                         f"{its[-1:]!r}")
    if dtype not in (torch.float16, torch.float32):
        raise ValueError(f"a packed loss history is float16 or float32, got dtype {dtype!r}")
    rounded = np.float16 if dtype == torch.float16 else np.float32
    steps, summed = [], 0.0
    for r in rows:  # each step rounds what the rounded steps before it left over, so errors do not add up
        steps.append(float(rounded(r[2] - summed)))
        summed += steps[-1]
    return {"loss": torch.tensor([r[1] for r in rows], dtype=dtype),       # [N]
            "step_seconds": torch.tensor(steps, dtype=dtype)}             # [N]


def history_file(path: str | Path) -> Path:
    """Where an export keeps its loss history: beside it, ``NAME.history.pth`` for ``NAME.pth``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.history{path.suffix or '.pth'}")


def write_history(path: str | Path, rows) -> Path:
    """Write the loss history of the export at ``path`` beside it (:func:`history_file`; float32
    :func:`pack_history` vectors).

    Why beside it: an export of issue 14's MAR-B-deep model holds 24.86 MB of EMA weights and must stay under 25 MB,
    while its history grows with every phase (~1,000 rows per CPU phase, ~7,000 per accelerator lease); inside the
    file, even at 4 bytes a row, it would outgrow the cap within a few phases."""
    out = history_file(path)
    with atomic_path(out) as tmp:  # never a torn history beside good weights
        torch.save(pack_history(rows, dtype=torch.float32), tmp)
    return out


def read_history(path: str | Path, state: dict) -> list[list[float]]:
    """``[[iteration, loss, seconds], ...]`` of the checkpoint at ``path`` (``state``: the dict it holds): from
    the file beside it (:func:`history_file`) when the checkpoint holds no ``loss_history`` (exports since issue 14's
    phase 20), else its own (run checkpoints, earlier exports). A file beside it must hold one row per iteration of
    the checkpoint's ``phase_iterations``, so a history left from other weights is refused."""
    if "loss_history" in state:
        return history_rows(state["loss_history"])
    side = history_file(path)
    if not side.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} keeps its loss history beside it, but {str(side)!r} was "
                              "not found; copy it with the checkpoint (mar_probe.train.export_ema writes both)")
    rows = history_rows(load_weights(side, what="loss history", error=CheckpointError))
    expected = sum(state.get("phase_iterations") or [])
    if len(rows) != expected:
        raise CheckpointError(f"loss history {str(side)!r} has {len(rows)} rows, but checkpoint {str(path)!r} was "
                              f"trained {expected} iterations (sum of its phase_iterations): it belongs to other "
                              "weights")
    return rows


def history_rows(history) -> list[list[float]]:
    """``[[iteration, loss, seconds], ...]`` of a stored loss history: packed as ``{"loss", "step_seconds"}``
    vectors (:func:`pack_history`), as a float32 ``[N, 2]`` tensor of (loss, cumulative seconds) (exports
    of issue 14's phases 11-13), or a list of rows (run checkpoints, older exports)."""
    if isinstance(history, dict):
        if set(history) != {"loss", "step_seconds"} or history["loss"].shape != history["step_seconds"].shape:
            raise ValueError(f"a packed loss history is {{'loss': [N], 'step_seconds': [N]}}, got "
                             f"{ {k: tuple(v.shape) for k, v in history.items()}!r}")
        seconds = torch.cumsum(history["step_seconds"].double(), 0)
        return [[i, loss, t] for i, (loss, t) in enumerate(zip(history["loss"].double().tolist(), seconds.tolist()))]
    if isinstance(history, torch.Tensor):
        if history.ndim != 2 or history.shape[1] != 2:
            raise ValueError(f"a packed loss history is a [N, 2] tensor of (loss, seconds), got shape "
                             f"{tuple(history.shape)!r}")
        return [[i, loss, seconds] for i, (loss, seconds) in enumerate(history.double().tolist())]
    return [list(r) for r in history]


def _pick_state_dict(state: dict, ema: bool, path) -> dict:
    key = "model_ema" if ema else "model"
    if key in state:
        return state[key]
    if "model" in state or "model_ema" in state:
        raise CheckpointError(f"checkpoint {str(path)!r} has no {key!r} weights; it has "
                              f"{sorted(k for k in state if k.startswith('model'))!r} (choose ema={not ema!r})")
    if all(isinstance(v, torch.Tensor) for v in state.values()):
        return state  # a bare state dict
    raise CheckpointError(f"checkpoint {str(path)!r} has neither 'model' nor 'model_ema'; keys: {sorted(state)[:8]!r}")


def config_from_checkpoint(state: dict, preset: str | None) -> MARConfig:
    """The model config: an explicit preset wins, else the stored mar_probe config, else a preset guess."""
    if preset is not None:
        return preset_config(preset)
    if "mar_probe_config" in state:
        return MARConfig.from_dict(state["mar_probe_config"])
    args = state.get("args")
    name = getattr(args, "model", None)
    if name in PRESETS:
        return preset_config(name)
    sd = state.get("model_ema", state.get("model", state))
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"this checkpoint holds no model weights: expected 'model'/'model_ema' state dicts "
                              f"(or a bare state dict of tensors), got keys {sorted(map(str, state))[:8]!r}")
    guess = suggest_preset(sd)
    if guess is None:
        raise CheckpointError("cannot tell the architecture of this checkpoint; pass preset=, one of "
                              f"{sorted(PRESETS)!r}")
    return preset_config(guess)


def _shapes(sd: dict) -> dict:
    return {k: tuple(v.shape) for k, v in sd.items()}


def suggest_preset(state_dict: dict) -> str | None:
    """The preset whose state-dict keys and shapes equal those of ``state_dict``, if any."""
    want = _shapes(state_dict)
    for name in PRESETS:
        with torch.device("meta"):
            model = MAR(preset_config(name))
        if _shapes(model.state_dict()) == want:
            return name
    return None


def check_state_dict(model: MAR, state_dict: dict) -> None:
    """Raise :class:`CheckpointError` naming missing/unexpected keys and shape conflicts."""
    have, want = _shapes(model.state_dict()), _shapes(state_dict)
    missing = sorted(set(have) - set(want))
    unexpected = sorted(set(want) - set(have))
    conflicts = [f"{k}: model {have[k]} vs checkpoint {want[k]}" for k in sorted(set(have) & set(want))
                 if have[k] != want[k]]
    if not (missing or unexpected or conflicts):
        return
    parts = [f"checkpoint does not fit model {model.config.name!r}:"]
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape conflicts", conflicts)):
        if items:
            parts.append(f"  {label} ({len(items)}): {items[:6]!r}{' ...' if len(items) > 6 else ''}")
    hint = _image_size_hint(model, want)
    if hint:
        parts.append(hint)
    guess = suggest_preset(state_dict)
    parts.append(f"  it fits preset {guess!r}" if guess else "  it fits none of the presets " + repr(sorted(PRESETS)))
    raise CheckpointError("\n".join(parts))


def _image_size_hint(model: MAR, want: dict) -> str | None:
    """Say so when the checkpoint was trained for another token grid (another image size)."""
    shape = want.get("diffusion_pos_embed_learned")
    if shape is None or shape[1] == model.seq_len:
        return None
    c = model.config
    grid = int(round(shape[1] ** 0.5))
    return (f"  a checkpoint of another image size: it holds {shape[1]} tokens (a {grid}x{grid} grid), but model "
            f"{c.name!r} expects {model.seq_len} ({model.seq_h}x{model.seq_w}: img_size={c.img_size!r}, "
            f"vae_stride={c.vae_stride!r}, patch_size={c.patch_size!r})")


def load_model(checkpoint: str | Path | None = None, preset: str | None = None, ema: bool = True,
               device: str | torch.device | None = "cpu", num_sampling_steps: str | int | None = None) -> MAR:
    """Load a MAR from a local checkpoint (default: the embedded Fashion-MNIST model), in eval mode."""
    dev = resolve_device(device)
    path = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    state = read_checkpoint(path)
    config = config_from_checkpoint(state, preset)
    if num_sampling_steps is not None:
        config = config.replace(num_sampling_steps=str(num_sampling_steps))
    sd = _pick_state_dict(state, ema, path)
    model = MAR(config)
    check_state_dict(model, sd)
    model.load_state_dict(sd, strict=True)
    model.sampling_defaults = _sampling_defaults(state, path)
    return model.to(dev).eval()
