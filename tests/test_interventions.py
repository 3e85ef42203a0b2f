"""Write hooks (issue 18, item 5): an edit changes exactly what it should, no edit changes nothing."""
import pytest
import torch

import mar_probe
from mar_probe.hooks import edit, trace
from mar_probe.probe import Intervention
from official_like import official_like

RUN = dict(num_iter=4, cfg=2.0, seed=3)
DEC = ["dec.0.hook_resid_post", "dec.1.attn.hook_v", "dec.1.hook_resid_post", "z"]


def _trace_once(model, names, edits=None):
    """One step-0 forward of both stacks under ``edits``; the traced tensors (after the edits)."""
    got = {}
    with edit(model, edits or {}), trace(model, names, lambda n, t: got.setdefault(n, t.clone())):
        mar_probe.sample(model, [1, 2], num_iter=1, cfg=2.0, seed=0)
    return got


def test_no_replacement_leaves_every_output_bitwise_equal(trained_like_tiny):
    m = trained_like_tiny
    plain = mar_probe.sample(m, [1, 2], **RUN)
    seen = []
    names = [h.name for h in mar_probe.hooks.list_hooks(m)]
    with edit(m, {n: (lambda name, t: seen.append(name)) for n in names}):
        edited = mar_probe.sample(m, [1, 2], **RUN)
    assert torch.equal(edited.tokens, plain.tokens)
    assert set(seen) == set(names)                                   # every edit ran, returning None
    assert all(not mod._forward_hooks for mod in m.modules())        # removed on exit


def test_head_ablation_changes_exactly_that_head_and_what_follows(trained_like_tiny):
    m = trained_like_tiny
    before = _trace_once(m, DEC)

    def ablate_head0(name, v):                                       # v [B', H, N, Dh]
        v = v.clone()
        v[:, 0] = 0
        return v
    after = _trace_once(m, DEC, {"dec.1.attn.hook_v": ablate_head0})
    assert torch.equal(after["dec.0.hook_resid_post"], before["dec.0.hook_resid_post"])   # upstream: untouched
    assert torch.equal(after["dec.1.attn.hook_v"][:, 1:], before["dec.1.attn.hook_v"][:, 1:])  # other heads
    assert after["dec.1.attn.hook_v"][:, 0].abs().max() == 0 < before["dec.1.attn.hook_v"][:, 0].abs().max()
    assert not torch.allclose(after["dec.1.hook_resid_post"], before["dec.1.hook_resid_post"])  # downstream moves
    assert not torch.allclose(after["z"], before["z"])


def test_patching_a_layer_with_its_own_clean_value_is_exact(trained_like_tiny):
    """Activation patching: replacing dec.1's residual by the value it has anyway gives the same tokens."""
    m = trained_like_tiny
    clean = {}
    with trace(m, ["dec.1.hook_resid_post"], lambda n, t: clean.setdefault(len(clean), t.clone())):
        plain = mar_probe.sample(m, [1, 2], **RUN)
    calls = iter(range(len(clean)))
    with edit(m, {"dec.1.hook_resid_post": lambda name, t: clean[next(calls)].clone()}):
        patched = mar_probe.sample(m, [1, 2], **RUN)
    assert torch.equal(patched.tokens, plain.tokens)


def test_intervention_freezes_a_token_key_at_an_earlier_step(trained_like_tiny):
    """The step-aware observer: token 5's K at decoder layer 0 is frozen at its step-1 value from step 2 on."""
    m = trained_like_tiny
    row = m.buffer_size + 5
    saved, seen = {}, {}

    def freeze(name, k, state):                                      # k [B', H, N, Dh]
        if state.step == 1:
            saved["k"] = k[..., row, :].clone()
        elif state.step > 1:
            k = k.clone()
            k[..., row, :] = saved["k"]
            return k

    iv = Intervention(m, {"dec.0.attn.hook_k": freeze})
    plain = mar_probe.sample(m, [1, 2], **RUN)
    with iv.attached():
        with trace(m, ["dec.0.attn.hook_k"], lambda n, t: seen.setdefault(len(seen), t[..., row, :].clone())):
            frozen = mar_probe.sample(m, [1, 2], observers=[iv], **RUN)
    assert all(torch.equal(seen[i], saved["k"]) for i in (2, 3)) and not torch.equal(seen[0], saved["k"])
    assert not torch.equal(frozen.tokens, plain.tokens)
    assert all(not mod._forward_hooks for mod in m.modules())
    assert torch.equal(mar_probe.sample(m, [1, 2], **RUN).tokens, plain.tokens)          # nothing left behind


def test_bad_edits_are_refused_with_what_was_expected(trained_like_tiny):
    m = trained_like_tiny
    with pytest.raises(ValueError, match="unknown hook name 'dec.9.attn.hook_k'"):
        with edit(m, {"dec.9.attn.hook_k": lambda n, t: None}):
            pass
    with pytest.raises(ValueError, match=r"edit of 'z' must return None or a tensor of shape \(4, 64, 32\) and "
                                         r"dtype torch.float32, got \(4, 64\) torch.float32"):
        with edit(m, {"z": lambda n, t: t[..., 0]}):
            mar_probe.sample(m, [1, 2], num_iter=1, cfg=2.0)
    assert all(not mod._forward_hooks for mod in m.modules())        # removed on error too
    with pytest.raises(ValueError, match="cannot be edited on this model: it is read from 'decoder_blocks.0.attn.qkv'"):
        with edit(official_like(m), {"dec.0.attn.hook_k": lambda n, t: None}):
            pass
    with pytest.raises(RuntimeError, match="pass it to the sampler's observers"):
        with Intervention(m, {"z": lambda n, t, s: None}).attached():
            mar_probe.sample(m, [1, 2], num_iter=1, cfg=2.0)
