"""Resolving hook names to module paths and attaching forward hooks (like baukit's ``TraceDict``).

A name resolves to a :class:`HookSite`: the module whose forward output carries the tensor, plus an optional
transform from that output to the hook's canonical shape. On mar_probe's own MAR the sites are the identity
``HookPoint`` modules; on an official MAR (timm ``Block``: fused ``attn.qkv``, no hook points) q/k/v come from
the ``attn.qkv`` output split per head, the block output is ``resid_post`` and ``z`` is recomputed from
``decoder_norm``'s output with the very operations of the official ``forward_mae_decoder``.
Hooks only read: they return ``None``, so the model's outputs do not change by a single bit.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable

import torch

from .. import vocab

STACKS = {vocab.STACK_PREFIX[s]: f"{s}_blocks" for s in vocab.STACKS}  # {"enc": "encoder_blocks", "dec": ...}
QUANTITIES = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_out", "hook_mlp_out", "hook_resid_mid",
              "hook_resid_post")
# official (timm Block) fallbacks: quantity -> (module path inside the block, transform kind)
_FALLBACK = {"attn.hook_q": ("attn.qkv", 0), "attn.hook_k": ("attn.qkv", 1), "attn.hook_v": ("attn.qkv", 2),
             "attn.hook_attn_out": ("attn", None), "hook_mlp_out": ("mlp", None), "hook_resid_post": ("", None)}


@dataclass(frozen=True)
class HookSite:
    """Where a hook name reads its tensor: ``module_path`` output, mapped through ``transform`` if given."""
    name: str
    module_path: str
    transform: Callable | None = None


@dataclass(frozen=True)
class HookInfo:
    """A hook name, the module it reads and a description of its tensor's shape."""
    name: str
    module_path: str
    shape: str


def _has_module(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _split_qkv(index: int, num_heads: int):
    def split(out):
        b, n, d3 = out.shape
        qkv = out.reshape(b, n, 3, num_heads, d3 // (3 * num_heads))  # [B, N, 3, H, Dh]
        return qkv.permute(2, 0, 3, 1, 4)[index]                       # [B, H, N, Dh]
    return split


def _official_z(model):
    def z(out):  # decoder_norm output [B, S+L, D] -> z [B, L, D], as the official forward_mae_decoder
        return out[:, model.buffer_size:] + model.diffusion_pos_embed_learned
    return z


def _name_error(model, name: str, why: str) -> ValueError:
    depths = {s: len(getattr(model, p)) for s, p in STACKS.items()}
    return ValueError(f"unknown hook name {name!r} ({why}); expected 'z' or '{{stack}}.{{layer}}.{{quantity}}' with "
                      f"stack in {tuple(STACKS)!r}, layer in 0..depth-1 (depths {depths!r}) and quantity in "
                      f"{QUANTITIES!r}, e.g. 'dec.1.attn.hook_k'; see mar_probe.hooks.list_hooks(model)")


def resolve_hook(model, name: str) -> HookSite:
    """The :class:`HookSite` of a hook name on ``model`` (mar_probe's MAR or an official one)."""
    if name == "z":
        if _has_module(model, "hook_z"):
            return HookSite(name, "hook_z")
        return HookSite(name, "decoder_norm", _official_z(model))
    stack, _, rest = name.partition(".")
    layer, _, quantity = rest.partition(".")
    if stack not in STACKS or quantity not in QUANTITIES or not layer.isdigit():
        raise _name_error(model, name, "not of the form stack.layer.quantity")
    blocks = getattr(model, STACKS[stack])
    if int(layer) >= len(blocks):
        raise _name_error(model, name, f"layer {int(layer)} out of range for {len(blocks)} {stack} blocks")
    prefix = f"{STACKS[stack]}.{int(layer)}"
    if _has_module(model, f"{prefix}.{quantity}"):
        return HookSite(name, f"{prefix}.{quantity}")
    if quantity not in _FALLBACK:
        raise ValueError(f"hook {name!r} is not available on this model: it has no module {prefix}.{quantity!s} "
                         f"and the quantity cannot be read from a module output; expected one of "
                         f"{tuple(_FALLBACK)!r} on a model without hook points")
    sub, index = _FALLBACK[quantity]
    path = f"{prefix}.{sub}" if sub else prefix
    transform = None if index is None else _split_qkv(index, blocks[int(layer)].attn.num_heads)
    return HookSite(name, path, transform)


def _stack_shapes(model, stack: str) -> dict[str, str]:
    block = getattr(model, STACKS[stack])[0]
    heads, width = block.attn.num_heads, block.attn.qkv.in_features
    rows = "Nenc=S+known (varies by step)" if stack == "enc" else f"N={model.buffer_size + model.seq_len}"
    qkv = f"[B', H={heads}, {rows}, Dh={width // heads}]"
    res = f"[B', {rows}, D={width}]"
    return {q: (qkv if q.startswith("attn.hook_") and q != "attn.hook_attn_out" else res) for q in QUANTITIES}


def list_hooks(model) -> list[HookInfo]:
    """Every hook name available on ``model`` with its module path and shape (B' = batch x CFG branches).

    Examples
    --------
    >>> [h.name for h in list_hooks(model)][:3]
    ['enc.0.attn.hook_q', 'enc.0.attn.hook_k', 'enc.0.attn.hook_v']
    """
    out = []
    for stack, path in STACKS.items():
        shapes = _stack_shapes(model, stack)
        for i in range(len(getattr(model, path))):
            for q in QUANTITIES:
                try:
                    site = resolve_hook(model, f"{stack}.{i}.{q}")
                except ValueError:
                    continue
                out.append(HookInfo(site.name, site.module_path, shapes[q]))
    dec = model.decoder_blocks[0].attn.qkv.in_features
    out.append(HookInfo("z", resolve_hook(model, "z").module_path, f"[B', L={model.seq_len}, D={dec}]"))
    return out


@contextmanager
def trace(model, names, callback: Callable[[str, torch.Tensor], None]):
    """Attach read-only forward hooks for ``names``; ``callback(name, tensor)`` sees each captured tensor.

    Parameters
    ----------
    model : torch.nn.Module
        mar_probe's MAR or an official MAR instance.
    names : iterable of str
        Hook names (see :func:`list_hooks`).
    callback : callable
        Called with the hook name and the detached tensor in its canonical shape, during the forward.
    """
    by_module: dict[str, list[HookSite]] = {}
    for name in dict.fromkeys(names):
        site = resolve_hook(model, name)
        by_module.setdefault(site.module_path, []).append(site)
    handles = []
    try:
        for path, sites in by_module.items():
            handles.append(model.get_submodule(path).register_forward_hook(_make_hook(sites, callback)))
        yield
    finally:
        for h in handles:
            h.remove()


EditFn = Callable[[str, torch.Tensor], "torch.Tensor | None"]


@contextmanager
def edit(model, edits: dict[str, EditFn]):
    """Attach write hooks: ``edits[name](name, tensor)`` may return a tensor that replaces the hook point's output.

    baukit's ``edit_output`` on mar_probe's hook points (issue 18): activation patching, freezing a token's K/V,
    ablating a head. The function sees the tensor in its canonical shape (as :func:`trace` does) and returns a
    replacement of the same shape and dtype, or None to leave it as it is. Hooks are scoped to ``model`` and
    removed on exit, also on error. Edits apply to every forward inside the block, reference forwards too (a
    strategy's oracle or the shadow then measure the edited model). A :func:`trace` entered inside the block
    sees the edited tensors; one entered outside it, the tensors before the edit.

    Parameters
    ----------
    model : torch.nn.Module
        mar_probe's MAR: edits need its identity hook points (an official MAR's ``attn.qkv`` fallback is refused).
    edits : dict
        Hook name (see :func:`list_hooks`) -> function of (name, tensor).
    """
    handles = []
    try:
        for name, fn in edits.items():
            site = resolve_hook(model, name)
            if site.transform is not None or not site.module_path.rsplit(".", 1)[-1].startswith("hook_"):
                raise ValueError(f"hook {name!r} cannot be edited on this model: it is read from "
                                 f"{site.module_path!r} through a transform, not from a hook point; expected "
                                 "mar_probe's MAR (load the checkpoint with mar_probe.load_model)")
            handles.append(model.get_submodule(site.module_path).register_forward_hook(_make_edit(name, fn)))
        yield
    finally:
        for h in handles:
            h.remove()


def _make_edit(name: str, fn: EditFn):
    def hook(module, inputs, output):
        new = fn(name, output)
        if new is None:
            return None
        if not isinstance(new, torch.Tensor) or new.shape != output.shape or new.dtype != output.dtype:
            got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"edit of {name!r} must return None or a tensor of shape {tuple(output.shape)} and "
                             f"dtype {output.dtype}, got {got}")
        return new
    return hook


_SUSPENDED = [0]


@contextmanager
def suspended():
    """Hooks attached by :func:`trace` see nothing inside this block (for reference forwards that a strategy or
    the shadow runs beside the sampled computation, which observers must not mistake for it)."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1


def _make_hook(sites, callback):
    def hook(module, inputs, output):
        if _SUSPENDED[0]:
            return
        out = output.detach()
        for site in sites:
            callback(site.name, site.transform(out) if site.transform is not None else out)
    return hook
