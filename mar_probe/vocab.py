"""The names every layer shares, declared once (issue 18, item 3): MAR's two transformer stacks, their short
prefixes in hook and variable names, and the two CFG branches.

The official MAR names its stacks' blocks ``encoder_blocks`` / ``decoder_blocks``; hook points and recorded
variables use the short prefixes (``enc.3.attn.hook_k``, ``dec_k``). The branches are the layout of MAR's batched
CFG forward, ``[cond; uncond]`` (``torch.cat([class_embedding, fake_latent])`` in the official ``sample_tokens``).
"""
from __future__ import annotations

from typing import Literal

Stack = Literal["encoder", "decoder"]
Branch = Literal["cond", "uncond"]

STACKS: tuple[Stack, ...] = ("encoder", "decoder")
STACK_PREFIX: dict[Stack, str] = {"encoder": "enc", "decoder": "dec"}
PREFIXES = tuple(STACK_PREFIX[s] for s in STACKS)       # ("enc", "dec")
BRANCHES: tuple[Branch, ...] = ("cond", "uncond")


def branches_for(cfg: float) -> tuple[Branch, ...]:
    """The CFG branches a step computes: only the conditional one at CFG 1.0 (the official sampler's rule)."""
    return BRANCHES[:1] if cfg == 1.0 else BRANCHES
