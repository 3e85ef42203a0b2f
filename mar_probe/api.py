"""The public sampling API: :func:`sample` and its :class:`SampleResult`."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from .models.checkpoints import resolve_sampling
from .models.tokenizer import PixelTokenizer
from .sampler import CFG_SCHEDULES, SampleRNG, Sampler


@dataclass
class SampleResult:
    """What one call of :func:`sample` produced.

    ``tokens`` [B, C, H, W] float32 has the layout of the official ``sample_tokens`` output; ``images`` is
    uint8 [B, H, W, C] when the model's tokens can be decoded (pixel tokens, or a VAE was given). ``cost`` is
    :meth:`mar_probe.strategies.Timer.report`: seconds and FLOPs per component, per step and in total.
    """
    tokens: torch.Tensor
    labels: np.ndarray
    orders: np.ndarray
    images: np.ndarray | None
    settings: dict
    timings: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)


def decode_images(model, tokens: torch.Tensor, vae=None) -> np.ndarray | None:
    """Decode [B, C, H, W] tokens to uint8 images [B, H, W, C], or None when no decoder is known."""
    c = model.config
    if c.tokenizer == "pixel":
        return PixelTokenizer(c.img_size, c.vae_stride, c.image_channels, c.crop_size).decode(tokens.cpu())
    if vae is None:
        return None
    from .models.vae import KL16Decoder
    decoder = vae if isinstance(vae, KL16Decoder) else KL16Decoder(vae)
    return decoder.decode_tokens(tokens)


def check_guidance(cfg, temperature) -> None:
    """The one check of CFG scale and temperature: finite, CFG >= 1 and temperature > 0 (issue 19: NaN passed)."""
    for name, value, ok, want in (("cfg", cfg, lambda v: v >= 1.0, ">= 1"),
                                  ("temperature", temperature, lambda v: v > 0, "> 0")):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{name} must be a finite number {want}, got {value!r}")


def _validate(model, labels, num_iter, cfg, cfg_schedule, temperature, batch_size) -> torch.Tensor:
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
    n = model.num_classes
    bad = labels[(labels < 0) | (labels >= n)]
    if len(bad):
        raise ValueError(f"label {int(bad[0])!r} is outside the model's class range [0, {n - 1}]")
    if len(labels) == 0:
        raise ValueError("labels is empty; expected at least one class label")
    if not isinstance(num_iter, int) or num_iter < 1:
        raise ValueError(f"num_iter must be a positive integer, got {num_iter!r}")
    if num_iter > model.seq_len:
        raise ValueError(f"num_iter {num_iter!r} exceeds the {model.seq_len} tokens to generate")
    if cfg_schedule not in CFG_SCHEDULES:
        raise ValueError(f"unknown cfg_schedule {cfg_schedule!r}; expected one of {CFG_SCHEDULES!r}")
    check_guidance(cfg, temperature)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    return labels


def _strategy(strategy):
    """A Strategy object from an object, a registered name or None (the full baseline)."""
    from .strategies import Strategy, available, create
    if strategy is None or isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        return create(strategy)
    raise ValueError(f"strategy must be a Strategy object or one of the registered names {available()!r}, "
                     f"got {strategy!r}")


def sample(model, labels, *, num_iter: int | None = None, cfg: float | None = None, cfg_schedule: str | None = None,
           temperature: float | None = None, seed: int = 0, rng: str = "own", batch_size: int | None = None,
           strategy=None, observers=(), vae=None, progress: bool = False) -> SampleResult:
    """Generate images with MAR's sampling semantics.

    Parameters
    ----------
    model : MAR
        A model in eval mode (see :func:`mar_probe.load_model`).
    labels : array-like of int
        One class label per image.
    num_iter, cfg, cfg_schedule, temperature
        As in the official ``sample_tokens``; None takes the model's recommended setting (a checkpoint's
        ``sampling_defaults``, see :func:`~mar_probe.models.checkpoints.resolve_sampling`), else the official
        defaults 64, 1.0, "linear", 1.0.
    seed : int
        Seed of this call's own generators (no global state is touched).
    rng : {"own", "official"}
        ``"official"`` consumes random numbers exactly like the official code after
        ``np.random.seed(seed); torch.manual_seed(seed)``.
    batch_size : int, optional
        Images per forward batch (default: all at once).
    strategy : Strategy or str, optional
        How each step is computed (default: the full baseline); a name is built with
        :func:`mar_probe.strategies.create` and its default options.
    observers : sequence
        Objects notified at each step (the probe).
    vae : optional
        A KL-16 VAE to decode latent tokens of ImageNet models.
    """
    s = resolve_sampling(model, num_iter=num_iter, cfg=cfg, cfg_schedule=cfg_schedule, temperature=temperature)
    num_iter, cfg, cfg_schedule, temperature = s["num_iter"], s["cfg"], s["cfg_schedule"], s["temperature"]
    labels = _validate(model, labels, num_iter, cfg, cfg_schedule, temperature, batch_size)
    device = next(model.parameters()).device
    gen = SampleRNG.create(seed, rng, device)
    strategy = _strategy(strategy)
    sampler = Sampler(model, strategy, observers, device)
    bs = batch_size or len(labels)
    outs, orders = [], []
    for i in tqdm(range(0, len(labels), bs), disable=not progress, desc="batches"):
        toks, ords = sampler.run(labels[i:i + bs].to(device), gen, num_iter=num_iter, cfg=cfg,
                                 cfg_schedule=cfg_schedule, temperature=temperature, progress=progress)
        outs.append(model.unpatchify(toks).float().cpu())
        orders.append(ords.cpu().numpy())
    tokens = torch.cat(outs)
    settings = dict(num_iter=num_iter, cfg=cfg, cfg_schedule=cfg_schedule, temperature=temperature, seed=seed,
                    rng=rng, num_sampling_steps=model.diffloss.num_sampling_steps,
                    strategy=sampler.strategy.to_dict(), model=model.config.name)
    return SampleResult(tokens=tokens, labels=labels.numpy(), orders=np.concatenate(orders),
                        images=decode_images(model, tokens, vae), settings=settings, timings=dict(sampler.timer.totals),
                        cost=sampler.timer.report())
