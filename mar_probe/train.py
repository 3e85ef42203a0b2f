"""MAR's training recipe on a small image dataset, resumable, with an EMA and a loss curve.

Random generation order, mask ratio from MAR's truncated normal, label drop for CFG, diffusion loss with
the cosine schedule (optionally on a random subset of masked tokens), AdamW with warm-up and cosine decay,
gradient clipping, EMA.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ._config import checked_fields
from ._io import atomic_path, file_sha256
from .models import DEFAULT_PRESET, MAR, preset_config
from .models.blocks import ATTENTION_KERNELS, set_attention_kernel
from .models.checkpoints import read_checkpoint, read_history, write_history
from .models.tokenizer import PixelTokenizer


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What to train and how."""
    preset: str = DEFAULT_PRESET
    dataset: str = "fashion"  # "fashion" (Fashion-MNIST IDX files) or "digits" (scikit-learn's 8x8, for tests)
    data_dir: str | None = None
    out_dir: str = "runs/train"
    iters: int = 1700
    batch_size: int = 64
    lr: float = 6e-4
    min_lr: float = 6e-5
    weight_decay: float = 0.02
    warmup_iters: int = 100
    grad_clip: float = 3.0
    ema_rate: float = 0.999
    ckpt_every: int = 100
    seed: int = 0
    threads: int = 0
    init: str | None = None  # start from the (EMA) weights of this checkpoint instead of random weights
    amp: str = "bf16"  # "bf16": transformer under bfloat16 autocast (the diffusion head stays float32); "none"
    attention: str = "explicit"  # softmax-attention kernel while training (models.blocks.ATTENTION_KERNELS)
    compile: bool = False  # torch.compile the encoder and decoder (dynamic shapes; about 1-2 min to compile)
    max_minutes: float = 0.0  # >0: stop (and save) once this phase trained this long (wall time, over resumes)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"; the random stream stays on the CPU (models.diffloss.rng_device)

    def __post_init__(self):
        for f in ("iters", "batch_size", "ckpt_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainConfig.{f} must be >= 1, got {getattr(self, f)!r}")
        if self.dataset not in ("fashion", "digits"):
            raise ValueError(f"TrainConfig.dataset must be 'fashion' or 'digits', got {self.dataset!r}")
        if self.amp not in ("bf16", "none"):
            raise ValueError(f"TrainConfig.amp must be 'bf16' or 'none', got {self.amp!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"TrainConfig.attention must be one of {ATTENTION_KERNELS!r}, got {self.attention!r}")
        if not (self.max_minutes >= 0 and math.isfinite(self.max_minutes)):
            raise ValueError(f"TrainConfig.max_minutes must be a finite number >= 0, got {self.max_minutes!r}")
        if not _is_device_name(self.device):
            raise ValueError(f"TrainConfig.device must be 'cpu', 'cuda' or 'cuda:N' (N a GPU index), "
                             f"got {self.device!r}")
        if self.lr <= 0 or not 0 <= self.ema_rate < 1:
            raise ValueError(f"need lr > 0 and 0 <= ema_rate < 1, got lr={self.lr!r}, ema_rate={self.ema_rate!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        return cls(**checked_fields(cls, data))


def _is_device_name(name) -> bool:
    kind, colon, index = str(name).partition(":")
    return name == "cpu" or kind == "cuda" and (not colon or index.isdigit())


def training_device(cfg: TrainConfig) -> torch.device:
    """The device to train on, checked against what this machine has (a CUDA device needs a CUDA build of torch
    and a visible GPU: ``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128``)."""
    device = torch.device(cfg.device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise RuntimeError(f"TrainConfig.device={cfg.device!r} but this machine has {count} CUDA device(s) "
                               f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                               "train with device='cpu' or on a machine with a GPU")
    return device


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, after the state of the last completed iteration was saved."""


def lr_at(cfg: TrainConfig, it: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at ``iters``."""
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / cfg.warmup_iters
    frac = (it - cfg.warmup_iters) / max(1, cfg.iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def _load_training_latents(cfg: TrainConfig, model: MAR):
    from .data import load_digits_images, load_fashion_mnist
    images, labels = load_fashion_mnist("train", cfg.data_dir) if cfg.dataset == "fashion" else load_digits_images()
    c = model.config
    tok = PixelTokenizer(c.img_size, c.vae_stride, c.image_channels, c.crop_size)
    return tok.encode(images), torch.as_tensor(labels)  # [N, C*s*s, h, w], [N]


@dataclass(kw_only=True)
class TrainState:
    """One run's model, EMA, optimiser and random streams: what an iteration advances and a checkpoint keeps.

    ``gen`` draws the generation orders, label drops, timesteps, noise and batch indices; it stays on the CPU whatever
    the device (``models.diffloss.rng_device``). ``np_rng`` draws the mask ratio (scipy's truncated normal).
    """
    cfg: TrainConfig
    model: MAR
    ema: MAR
    opt: torch.optim.Optimizer
    gen: torch.Generator
    np_rng: np.random.Generator

    @classmethod
    def create(cls, cfg: TrainConfig, device: torch.device | str = "cpu") -> TrainState:
        """Random weights from ``cfg.seed`` (the same on every device: made on the CPU, then moved)."""
        torch.manual_seed(cfg.seed)
        model = MAR(preset_config(cfg.preset))
        ema = copy.deepcopy(model).eval()
        model.to(device), ema.to(device)  # before the optimizer: a resumed optimizer state follows its parameters
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        return cls(cfg=cfg, model=model, ema=ema, opt=opt, gen=torch.Generator().manual_seed(cfg.seed),
                   np_rng=np.random.default_rng(cfg.seed))

    def rng_state(self) -> dict:
        return {"torch": self.gen.get_state(), "numpy": self.np_rng.bit_generator.state}

    def restore(self, state: dict) -> tuple[int, list]:
        """Load a checkpoint written by :meth:`save`; return (iterations done, loss history)."""
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["model_ema"])
        self.opt.load_state_dict(state["optimizer"])
        if state.get("rng_state"):
            self.gen.set_state(state["rng_state"]["torch"])
            self.np_rng.bit_generator.state = state["rng_state"]["numpy"]
        return state["epoch"], list(state["loss_history"])

    def save(self, path: Path, done: int, history: list, rng: dict) -> None:
        """Atomically write a checkpoint in the official layout plus mar_probe's configs and the RNG state ``rng``
        (taken after iteration ``done``, so that a resume repeats no draw)."""
        state = {"rng_state": rng, "model": self.model.state_dict(), "model_ema": self.ema.state_dict(),
                 "optimizer": self.opt.state_dict(), "epoch": done, "args": argparse.Namespace(**self.cfg.to_dict()),
                 "mar_probe_config": self.model.config.to_dict(), "train_config": self.cfg.to_dict(),
                 "loss_history": history}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def step(self, latents: torch.Tensor, labels: torch.Tensor, it: int) -> float:
        """Iteration ``it`` on a batch drawn from ``latents`` [N, C, H, W] and ``labels`` [N]; returns its loss."""
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, it)
        idx = torch.randint(0, latents.shape[0], (cfg.batch_size,), generator=self.gen).to(latents.device)
        with torch.autocast(latents.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            loss = self.model(latents[idx], labels[idx], generator=self.gen, np_rng=self.np_rng)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        ema_update(self.ema, self.model, min(cfg.ema_rate, (1 + it) / (10 + it)))
        return loss.item()


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, rate: float) -> None:
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(rate).add_(pm.detach(), alpha=1 - rate)


def train(cfg: TrainConfig, resume: bool = True) -> Path:
    """Train (or resume) and return the path of ``checkpoint-last.pth``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ckpt_path = Path(cfg.out_dir) / "checkpoint-last.pth"
    device = training_device(cfg)
    run = TrainState.create(cfg, device)
    start, history = 0, []
    if resume and ckpt_path.exists():
        start, history = run.restore(read_checkpoint(ckpt_path))
    elif cfg.init:
        _warm_start(run.model, run.ema, cfg.init)
    latents, labels = (t.to(device) for t in _load_training_latents(cfg, run.model))
    _prepare_for_speed(cfg, run.model)
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)  # only now: a bad preset, init or dataset leaves no folder
    _loop(run, latents, labels, start, history, ckpt_path)
    return ckpt_path


def _prepare_for_speed(cfg: TrainConfig, model: MAR) -> None:
    """The training-only speed settings: the attention kernel and, optionally, compiled stacks.

    Neither changes the state dict: a checkpoint trained either way loads and samples the same way.
    """
    set_attention_kernel(model, cfg.attention)
    if cfg.compile:
        # dynamic=True: the encoder's row count changes with every iteration's mask ratio
        model.forward_mae_encoder = torch.compile(model.forward_mae_encoder, dynamic=True)
        model.forward_mae_decoder = torch.compile(model.forward_mae_decoder, dynamic=True)


def _warm_start(model, ema, path) -> None:
    """Copy the weights of a checkpoint (EMA when present) into both the model and its EMA."""
    from .models.checkpoints import _pick_state_dict, check_state_dict
    sd = _pick_state_dict(read_checkpoint(path), ema=True, path=path)
    check_state_dict(model, sd)
    model.load_state_dict(sd)
    ema.load_state_dict(sd)


def _loop(run: TrainState, latents, labels, start: int, history: list, ckpt_path: Path) -> None:
    """Iterate from ``start``; Ctrl-C saves the state as of the last completed iteration (exactly resumable)."""
    cfg = run.cfg
    run.model.train()
    # history times are cumulative over resumed runs of the same phase
    done, rng_done, t0 = start, run.rng_state(), time.time() - (history[-1][2] if history else 0.0)
    bar = tqdm(range(start, cfg.iters), initial=start, total=cfg.iters, desc="train", smoothing=0.05)
    try:
        for it in bar:
            loss = run.step(latents, labels, it)
            done, rng_done = it + 1, run.rng_state()
            history.append([it, loss, time.time() - t0])
            bar.set_postfix(loss=f"{loss:.4f}")
            if done % cfg.ckpt_every == 0:
                run.save(ckpt_path, done, history, rng_done)
            if cfg.max_minutes and time.time() - t0 >= 60 * cfg.max_minutes:
                print(f"\nstopping after iteration {done}: --max-minutes {cfg.max_minutes:g} reached")
                break
    except KeyboardInterrupt:
        run.save(ckpt_path, done, history, rng_done)
        raise TrainingInterrupted(f"interrupted after iteration {done} of {cfg.iters}; {ckpt_path} is saved: rerun "
                                  "the same command to resume exactly") from None
    run.save(ckpt_path, done, history, rng_done)
    (ckpt_path.parent / "loss_history.json").write_text(json.dumps(history))
    if history:
        _plot_history(history, ckpt_path.parent / "loss_curve.png")


def _plot_history(history: list, path: Path) -> None:
    """The loss curve beside the checkpoint. A failure to draw it warns instead of raising: the checkpoint is
    saved, and raising would skip the ``--export`` that follows (issue 14's phase 11 lost its export so)."""
    try:
        from .plot.training import plot_loss_curve
        plot_loss_curve(history, path)
    except Exception as exc:  # noqa: BLE001 - any plotting failure; the weights matter, not the figure
        import warnings
        warnings.warn(f"loss curve not written to {str(path)!r}: {exc!r}; the checkpoint is saved (plot it with "
                      "mar_probe.plot.training.plot_loss_curve on its loss_history)", RuntimeWarning, stacklevel=2)


def export_ema(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the EMA weights of a training checkpoint as a small file the loader accepts on its own.

    A run warm-started from an exported file (``--init``) is the next phase of that model: the export carries the
    earlier phases' configs (``train_phases``), their iteration counts (``phase_iterations``) and its recommended
    ``sampling_defaults`` (the shipped default's next phase stays a drop-in replacement); their loss
    history, continued by this phase's (iterations and seconds cumulative), goes beside it
    (:func:`~mar_probe.models.checkpoints.write_history`; read it with ``read_history``), so the two files tell a
    model's whole training, session after session.
    """
    state = read_checkpoint(checkpoint)
    earlier = _earlier_phases(state["train_config"].get("init"))
    phases, history, lengths = earlier.phases, earlier.history, earlier.lengths
    it0, t0 = (history[-1][0] + 1, history[-1][2]) if history else (0, 0.0)
    history += [[it0 + it, loss, t0 + t] for it, loss, t in state["loss_history"]]
    slim = {"model_ema": state["model_ema"], "args": state["args"], "mar_probe_config": state["mar_probe_config"],
            "train_config": state["train_config"], "epoch": state["epoch"],
            "train_phases": phases + [state["train_config"]], "phase_iterations": lengths + [state["epoch"]]}
    if earlier.sampling_defaults:
        slim["sampling_defaults"] = earlier.sampling_defaults
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_history(out, history)  # first: an export never stands without its history
    with atomic_path(out) as tmp:
        torch.save(slim, tmp)
    return out


@dataclass(frozen=True, kw_only=True)
class EarlierPhases:
    """What a warm start's ``--init`` file holds of the model's training so far."""
    phases: list = field(default_factory=list)   # each phase's TrainConfig as a dict
    history: list = field(default_factory=list)  # [iteration, loss, cumulative seconds] rows
    lengths: list = field(default_factory=list)  # iterations per phase
    sampling_defaults: dict | None = None       # the file's recommended sampling settings, if any


def _earlier_phases(init: str | None) -> EarlierPhases:
    """The training of the file a warm start began from (empty if none, or not trained by mar_probe)."""
    if not init or not Path(init).is_file():
        return EarlierPhases()
    prev = read_checkpoint(init)
    if "train_config" not in prev:  # not trained by mar_probe (e.g. an official checkpoint)
        return EarlierPhases()
    history = read_history(init, prev)
    return EarlierPhases(phases=list(prev.get("train_phases") or [prev["train_config"]]), history=history,
                         lengths=list(prev.get("phase_iterations") or [len(history)]),
                         sampling_defaults=prev.get("sampling_defaults"))


def average_exports(paths, out: str | Path) -> Path:
    """Write the uniform average of the EMA weights of several exports of one model (e.g. consecutive phases).

    Each phase's EMA (``ema_rate`` 0.999) remembers about its last thousand iterations; averaging the exports of
    consecutive phases is a longer memory over the same trajectory (issue 14: the distance stopped falling between
    phases within one seed's noise). The exports must share ``mar_probe_config`` and state-dict shapes; the average
    (in float64, stored in each tensor's dtype) carries the last export's training record, its loss history beside
    it, and ``averaged_from`` (each source's path and SHA-256), so nobody mistakes it for a trained phase.
    """
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two exports, got {[str(p) for p in paths]!r}")
    states = [read_checkpoint(p) for p in paths]
    _check_one_model(paths, states)
    average = {k: (sum(s["model_ema"][k].double() for s in states) / len(states)).to(v.dtype)
               for k, v in states[0]["model_ema"].items()}
    sources = [{"path": str(p), "sha256": file_sha256(p)} for p in paths]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_history(out, read_history(paths[-1], states[-1]))  # first: an export never stands without its history
    with atomic_path(out) as tmp:
        torch.save({**states[-1], "model_ema": average, "averaged_from": sources}, tmp)
    return out


def _check_one_model(paths: list[Path], states: list[dict]) -> None:
    """Refuse exports of different models: another config, or other weight names or shapes."""
    first = states[0]
    shapes = {k: tuple(v.shape) for k, v in first["model_ema"].items()}
    for path, state in zip(paths[1:], states[1:]):
        if state.get("mar_probe_config") != first.get("mar_probe_config"):
            raise ValueError(f"{str(path)!r} is another model than {str(paths[0])!r}: their mar_probe_config differ")
        if {k: tuple(v.shape) for k, v in state["model_ema"].items()} != shapes:
            raise ValueError(f"{str(path)!r} and {str(paths[0])!r} hold different weights (names or shapes)")
