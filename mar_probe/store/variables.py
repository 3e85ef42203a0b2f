"""The recorded variables, each declared once (issue 18, item 3): the hook points it reads, its dimensions and how
its stored value is derived from what those hooks saw.

Before this table, the probe, the schema and the selection each kept their own list of names and their own special
cases (``z``, ``z_cfg_resid``, ``attn_gen``); now they read :data:`VARIABLES`, so a new variable is one
:class:`Variable` here plus, if it is derived in a new way, one derivation in the probe.

Stack variables are ``{prefix}_{quantity}`` (``enc_k``, ``dec_resid_post``) for every quantity of
:data:`STACK_QUANTITIES`; the decoder adds ``z`` (its output, what the head reads), ``z_cfg_resid``
(``z_cond - z_uncond``) and ``attn_gen`` (MARché's selection score).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..vocab import PREFIXES

__all__ = ["DIMS_PER_STACK", "STACK_QUANTITIES", "VARIABLES", "Derivation", "Variable"]

Derivation = Literal["capture", "cfg_resid", "attn_gen"]
"""How a variable's value is made: ``capture`` stores the hook's tensor as it is (split by CFG branch);
``cfg_resid`` the difference of the two branches of one hook's tensor (float32, then the storage dtype);
``attn_gen`` the head- and generating-row-averaged softmax attention from the layer's q and k hooks."""

DIMS_PER_STACK = ("layer", "head", "d_head", "d_model")
"""Dimensions whose size belongs to a stack: named ``enc_layer``/``dec_head``... when the stacks differ."""

_HEADS, _MODEL = ("head", "d_head"), ("d_model",)
STACK_QUANTITIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "q": ("attn.hook_q", _HEADS, "attention queries, per head"),
    "k": ("attn.hook_k", _HEADS, "attention keys, per head"),
    "v": ("attn.hook_v", _HEADS, "attention values, per head"),
    "resid_post": ("hook_resid_post", _MODEL, "the block's output (residual stream after the MLP)"),
    "resid_mid": ("hook_resid_mid", _MODEL, "the residual stream between attention and MLP"),
    "attn_out": ("attn.hook_attn_out", _MODEL, "the attention's output projection"),
    "mlp_out": ("hook_mlp_out", _MODEL, "the MLP's output"),
}
"""Quantity -> (hook point relative to a block, trailing dims, description) of the per-layer stack variables."""


@dataclass(frozen=True, kw_only=True)
class Variable:
    """One recorded variable.

    stack : the stack whose sizes its dims take (``enc``/``dec``); per layer of it when ``"layer"`` is in ``dims``.
    hooks : hook points it reads: relative to a block of ``stack`` for a per-layer variable (``attn.hook_k`` becomes
        ``dec.3.attn.hook_k``), the model's own hook otherwise (``z``).
    dims : its dimensions after ``sample, step``, with generic names (``layer``, ``head``, ``d_head``, ``d_model``
        take the stack's prefix in a store whose stacks differ in them).
    derive : see :data:`Derivation`.
    description : one line, stored as the variable's ``description`` attribute.
    """
    name: str
    stack: str
    hooks: tuple[str, ...]
    dims: tuple[str, ...]
    derive: Derivation = "capture"
    description: str

    @property
    def layered(self) -> bool:
        """Whether it holds one value per layer of its stack."""
        return "layer" in self.dims

    @property
    def needs_both_branches(self) -> bool:
        """Whether it is made from both CFG branches (so a run at CFG 1.0, which has one, cannot record it)."""
        return "branch" not in self.dims

    def hook_names(self, layer: int | None = None) -> tuple[str, ...]:
        """The full hook names it reads (at ``layer`` of its stack for a per-layer variable)."""
        return tuple(f"{self.stack}.{layer}.{h}" for h in self.hooks) if self.layered else self.hooks


def _stack_variables() -> list[Variable]:
    return [Variable(name=f"{s}_{q}", stack=s, hooks=(hook,), dims=("branch", "layer", "token") + tail,
                     description=f"{s}oder {doc}")
            for s in PREFIXES for q, (hook, tail, doc) in STACK_QUANTITIES.items()]


VARIABLES: dict[str, Variable] = {v.name: v for v in _stack_variables() + [
    Variable(name="z", stack="dec", hooks=("z",), dims=("branch", "token", "d_model"),
             description="decoder output, the diffusion head's condition; NaN on rows served from a cache"),
    Variable(name="z_cfg_resid", stack="dec", hooks=("z",), dims=("token", "d_model"), derive="cfg_resid",
             description="z_cond - z_uncond, the CFG residual; NaN where either branch's z is"),
    Variable(name="attn_gen", stack="dec", hooks=("attn.hook_q", "attn.hook_k"), dims=("branch", "layer", "token"),
             derive="attn_gen", description="attention the generating tokens pay to each token, mean over heads and "
             "generating rows (MARche's selection score); NaN at layers where some keys came from a cache"),
]}
"""Every recordable activation variable, by name, in storage order."""
