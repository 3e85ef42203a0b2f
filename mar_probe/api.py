"""The public sampling API: :func:`sample` and its :class:`SampleResult`."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from .engine.loop import SampleRNG, Sampler
from .engine.sampling import SamplingConfig, check_guidance, head_steps_applied, sampling_config
from .models.tokenizer import PixelTokenizer

__all__ = ["SampleResult", "check_guidance", "decode_images", "sample"]  # check_guidance: its old home


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


def check_labels(model, labels, batch_size) -> torch.Tensor:
    """Labels as a [B] long tensor, each within the model's classes; ``batch_size`` None or >= 1."""
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
    n = model.num_classes
    bad = labels[(labels < 0) | (labels >= n)]
    if len(bad):
        raise ValueError(f"label {int(bad[0])!r} is outside the model's class range [0, {n - 1}]")
    if len(labels) == 0:
        raise ValueError("labels is empty; expected at least one class label")
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


def sample(model, labels, *, sampling: SamplingConfig | None = None, num_iter: int | None = None,
           cfg: float | None = None, cfg_schedule: str | None = None, temperature: float | None = None,
           head_steps: str | None = None, rng: str | None = None, seed: int = 0, batch_size: int | None = None,
           strategy=None, observers=(), vae=None, progress: bool = False) -> SampleResult:
    """Generate images with MAR's sampling semantics.

    Parameters
    ----------
    model : MAR
        A model in eval mode (see :func:`mar_probe.load_model`).
    labels : array-like of int
        One class label per image.
    sampling : SamplingConfig, optional
        The sampling settings (:class:`~mar_probe.engine.SamplingConfig`); fields left None take the model's
        recommended setting (a checkpoint's ``sampling_defaults``), else the official defaults 64, 1.0,
        "linear", 1.0 and the model's head steps.
    num_iter, cfg, cfg_schedule, temperature, head_steps, rng
        Shortcuts for the same fields; a value given here (not None) overrides ``sampling``'s.
        ``rng="official"`` consumes random numbers exactly like the official code after
        ``np.random.seed(seed); torch.manual_seed(seed)``.
    seed : int
        Seed of this call's own generators (no global state is touched).
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
    s = sampling_config(sampling, num_iter=num_iter, cfg=cfg, cfg_schedule=cfg_schedule, temperature=temperature,
                        head_steps=head_steps, rng=rng).resolve(model)
    labels = check_labels(model, labels, batch_size)
    device = next(model.parameters()).device
    gen = SampleRNG.create(seed, s.rng, device)
    sampler = Sampler(model, _strategy(strategy), observers, device)
    bs = batch_size or len(labels)
    outs, orders = [], []
    with head_steps_applied(model, s.head_steps):
        for i in tqdm(range(0, len(labels), bs), disable=not progress, desc="batches"):
            toks, ords = sampler.run(labels[i:i + bs].to(device), gen, num_iter=s.num_iter, cfg=s.cfg,
                                     cfg_schedule=s.cfg_schedule, temperature=s.temperature, progress=progress)
            outs.append(model.unpatchify(toks).float().cpu())
            orders.append(ords.cpu().numpy())
    tokens = torch.cat(outs)
    settings = dict(num_iter=s.num_iter, cfg=s.cfg, cfg_schedule=s.cfg_schedule, temperature=s.temperature,
                    seed=seed, rng=s.rng, num_sampling_steps=s.head_steps, strategy=sampler.strategy.to_dict(),
                    model=model.config.name)
    return SampleResult(tokens=tokens, labels=labels.numpy(), orders=np.concatenate(orders),
                        images=decode_images(model, tokens, vae), settings=settings, timings=dict(sampler.timer.totals),
                        cost=sampler.timer.report())
