"""The MAR model: official parameter layout, checkpoint loading and its errors, attention kernel."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from mar_probe import create_model, load_model
from mar_probe.models import MAR, MARConfig, preset_config
from mar_probe.models.blocks import explicit_attention
from mar_probe.models.checkpoints import CheckpointError, check_state_dict, suggest_preset

MANIFEST = Path(__file__).parent / "data" / "mar_base_state_dict_shapes.json"


def _meta_model(name):
    with torch.device("meta"):
        return MAR(preset_config(name))


def test_mar_base_state_dict_equals_official_layout():
    official = json.loads(MANIFEST.read_text())  # dumped from the official MAR code's mar_base
    sd = _meta_model("mar_base").state_dict()
    assert [[k, list(v.shape)] for k, v in sd.items()] == official
    assert len(sd) == 364
    assert sum(v.numel() for v in sd.values()) == 207_924_768


def test_official_format_state_dict_loads_strict():
    official = json.loads(MANIFEST.read_text())
    sd = {k: torch.empty(shape, device="meta") for k, shape in official}
    model = _meta_model("mar_base")
    check_state_dict(model, sd)
    result = model.load_state_dict(sd, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_attention_kernel_equals_explicit_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, generator=g) for _ in range(3))
    from mar_probe.models.blocks import Attention
    fused = Attention(24, 3).attend(q, k, v)
    torch.testing.assert_close(fused, explicit_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_config_round_trip_and_validation():
    cfg = preset_config("mar_tiny")
    assert MARConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="not divisible by encoder_num_heads"):
        preset_config("mar_tiny", encoder_num_heads=5)
    with pytest.raises(ValueError, match="unknown tokenizer 'jpeg'"):
        preset_config("mar_tiny", tokenizer="jpeg")
    with pytest.raises(ValueError, match=r"unknown MARConfig field\(s\) \['colour'\]"):
        MARConfig.from_dict({**cfg.to_dict(), "colour": 1})


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown preset 'mar_gigantic'.*mar_base"):
        create_model("mar_gigantic")


def _save(path, model, **extra):
    torch.save({"model": model.state_dict(), "model_ema": model.state_dict(),
                "args": argparse.Namespace(model="x"), **extra}, path)


def test_checkpoint_round_trip_rebuilds_custom_config(tmp_path, tiny_model):
    custom = MAR(preset_config("mar_tiny", encoder_depth=3, name="custom")).eval()
    _save(tmp_path / "c.pth", custom, mar_probe_config=custom.config.to_dict())
    loaded = load_model(tmp_path / "c.pth")
    assert loaded.config == custom.config
    for (k, a), b in zip(custom.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_checkpoint_for_another_preset_names_keys_and_suggests(tmp_path):
    other = MAR(preset_config("mar_tiny_latent"))
    _save(tmp_path / "other.pth", other)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "other.pth", preset="mar_tiny")
    msg = str(err.value)
    assert "shape conflicts" in msg and "class_emb.weight" in msg and "fits preset 'mar_tiny_latent'" in msg
    assert suggest_preset(other.state_dict()) == "mar_tiny_latent"


def test_missing_checkpoint_and_ema_choice(tmp_path, tiny_model):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_model(tmp_path / "nope.pth", preset="mar_tiny")
    torch.save({"model_ema": tiny_model.state_dict()}, tmp_path / "ema_only.pth")
    assert load_model(tmp_path / "ema_only.pth", preset="mar_tiny") is not None
    with pytest.raises(CheckpointError, match="no 'model' weights"):
        load_model(tmp_path / "ema_only.pth", preset="mar_tiny", ema=False)


def test_checkpoint_with_arbitrary_pickle_is_refused(tmp_path, tiny_model):
    torch.save({"model": tiny_model.state_dict(), "evil": Path("x")}, tmp_path / "p.pth")
    from mar_probe.models.checkpoints import CheckpointError
    with pytest.raises(CheckpointError, match="refused as untrusted: .*the global 'pathlib.PosixPath'") as info:
        load_model(tmp_path / "p.pth", preset="mar_tiny")
    assert "weights_only" not in str(info.value)


def test_cuda_device_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from mar_probe.models.checkpoints import resolve_device
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")


def test_checkpoint_of_another_image_size_says_so(tmp_path):
    bigger = MAR(preset_config("mar_tiny", img_size=32))
    _save(tmp_path / "big.pth", bigger)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "big.pth", preset="mar_tiny")
    msg = str(err.value)
    assert "another image size" in msg and "256 tokens (a 16x16 grid)" in msg and "expects 64 (8x8" in msg
    assert "img_size=16" in msg


def test_recommended_sampling_settings_travel_with_the_checkpoint(tmp_path, tiny_model):
    from mar_probe import sample
    from mar_probe.engine import SamplingConfig
    from mar_probe.models.checkpoints import write_sampling_defaults
    path = tmp_path / "t.pth"
    _save(path, tiny_model, mar_probe_config=tiny_model.config.to_dict())
    plain = load_model(path)
    assert plain.sampling_defaults == {}
    assert SamplingConfig().resolve(plain) == SamplingConfig(num_iter=64, cfg=1.0, cfg_schedule="linear",
                                                             temperature=1.0, head_steps="10", rng="own")
    write_sampling_defaults(path, temperature=0.5, num_iter=4)
    model = load_model(path)
    assert SamplingConfig(cfg=3.0).resolve(model) == SamplingConfig(num_iter=4, cfg=3.0, cfg_schedule="linear",
                                                                    temperature=0.5, head_steps="10")
    assert SamplingConfig(temperature=0.9).resolve(model).temperature == 0.9  # an explicit value wins
    res = sample(model, [0, 1], seed=3)
    assert res.settings["temperature"] == 0.5 and res.settings["num_iter"] == 4
    explicit = sample(model, [0, 1], seed=3, temperature=0.5, num_iter=4, cfg=1.0)
    assert torch.equal(res.tokens, explicit.tokens)
    with pytest.raises(CheckpointError, match=r"unknown sampling_defaults \['temp'\]"):
        write_sampling_defaults(path, temp=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        SamplingConfig(steps=3)
