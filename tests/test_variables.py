"""The recorded variables are declared once (issue 18, item 3): their hooks exist, the store's dims follow the
declarations, and a new variable is one declaration (the probe, schema and selection read the table)."""
import numpy as np
import pytest

import mar_probe
from mar_probe.hooks import list_hooks
from mar_probe.probe import Probe, SelectionSpec
from mar_probe.store.schema import ModelDims, resolve
from mar_probe.store.spec import ACTIVATIONS
from mar_probe.store.variables import VARIABLES, Variable
from conftest import perturbed_tiny

RUN = dict(num_iter=4, cfg=2.0, seed=3)


def test_every_declared_hook_exists_at_every_layer(deep_tiny):
    names = {h.name for h in list_hooks(deep_tiny)}
    dims = ModelDims.from_model(deep_tiny)
    for var in VARIABLES.values():
        layers = range(getattr(dims, var.stack).depth) if var.layered else [None]
        for layer in layers:
            missing = set(var.hook_names(layer)) - names
            assert not missing, (var.name, layer, missing)
    assert tuple(VARIABLES) == ACTIVATIONS
    assert VARIABLES["attn_gen"].hook_names(3) == ("dec.3.attn.hook_q", "dec.3.attn.hook_k")
    assert VARIABLES["z"].hook_names() == ("z",) and not VARIABLES["z"].layered


@pytest.mark.parametrize("overrides, layer_dim", [({}, "layer"), (dict(encoder_depth=3, decoder_depth=2), "dec_layer")])
def test_store_dims_follow_the_declarations(overrides, layer_dim):
    model = perturbed_tiny(**overrides)
    layout = resolve(SelectionSpec(variables=ACTIVATIONS), model, num_samples=2, num_iter=4, cfg=2.0)
    dims = ModelDims.from_model(model)
    for name, var in VARIABLES.items():
        got = layout.variables[name]
        stacked = {d: (layer_dim.replace("dec", var.stack) if d == "layer" else d) for d in var.dims}
        assert got.dims == ("sample", "step") + tuple(stacked[d] for d in var.dims), name
        assert got.attrs["description"] == var.description
        if var.layered:
            assert got.shape[3] == getattr(dims, var.stack).depth
    assert layout.variables["dec_k"].shape[-2:] == (dims.dec.heads, dims.dec.d_head)
    assert layout.variables["z_cfg_resid"].dims == ("sample", "step", "token", "d_model")


def test_a_variable_from_both_branches_is_refused_at_cfg_one(deep_tiny):
    assert [v for v in VARIABLES.values() if v.needs_both_branches] == [VARIABLES["z_cfg_resid"]]
    with pytest.raises(ValueError, match=r"z_cfg_resid needs both CFG branches; expected cfg != 1, got cfg=1.0"):
        resolve(SelectionSpec(variables="dec_k,z_cfg_resid"), deep_tiny, num_samples=1, num_iter=4, cfg=1.0)


def _record(model, spec):
    probe = Probe.for_run(model, spec, num_samples=2, num_iter=RUN["num_iter"], cfg=RUN["cfg"])
    probe.begin_batch([0, 1])
    with probe.attached():
        mar_probe.sample(model, [1, 2], observers=[probe], **RUN)
    return probe.records


def test_a_new_variable_is_one_declaration(deep_tiny, monkeypatch):
    """A variable declared on the decoder's resid_mid hook records exactly what dec_resid_mid records, with no
    change to the probe or the schema; undeclared, it is refused naming the declared ones."""
    with pytest.raises(ValueError, match=r"unknown variable\(s\) \['dec_mid'\]; expected some of \('enc_q'"):
        SelectionSpec(variables="dec_mid")
    mid = VARIABLES["dec_resid_mid"]
    monkeypatch.setitem(VARIABLES, "dec_mid", Variable(name="dec_mid", stack="dec", hooks=mid.hooks, dims=mid.dims,
                                                       description="a copy"))
    records = _record(deep_tiny, SelectionSpec(variables="dec_mid,dec_resid_mid", dtype="float32"))
    assert len(records) == RUN["num_iter"]
    for rec in records:
        assert rec.arrays["dec_mid"].shape == rec.arrays["dec_resid_mid"].shape
        assert np.array_equal(rec.arrays["dec_mid"], rec.arrays["dec_resid_mid"], equal_nan=True)
        assert not np.isnan(rec.arrays["dec_mid"]).all()
