"""Hook points of MAR, named like TransformerLens and attached as forward hooks by module path.

Names: ``enc.{i}.attn.hook_q/k/v`` and ``dec.{i}.attn.hook_q/k/v`` [B', H, N, Dh]; ``{stack}.{i}.attn.hook_attn_out``,
``{stack}.{i}.hook_mlp_out``, ``{stack}.{i}.hook_resid_mid`` and ``{stack}.{i}.hook_resid_post`` [B', N, D]; ``z``
[B', L, D] (the decoder output fed to the diffusion head, all CFG branches). See :func:`list_hooks`.
:func:`trace` reads them; :func:`edit` may replace them (interventions).
"""
from .points import EditFn, HookInfo, HookSite, edit, list_hooks, resolve_hook, suspended, trace

__all__ = ["EditFn", "HookInfo", "HookSite", "edit", "list_hooks", "resolve_hook", "suspended", "trace"]
