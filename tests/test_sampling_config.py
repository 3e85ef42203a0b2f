"""SamplingConfig: the one source of sampling settings and their defaults (issue 18, item 2)."""
import numpy as np
import pytest
import torch

from mar_probe import load_model, sample
from mar_probe.cli import main
from mar_probe.compare import CompareConfig, compare
from mar_probe.engine import OFFICIAL, SamplingConfig
from mar_probe.probe.record import sample_seeds
from mar_probe.store import open_run

from conftest import perturbed_tiny


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A mar_probe checkpoint of a perturbed mar_tiny with no recommended sampling settings."""
    model = perturbed_tiny(seed=4)
    path = tmp_path_factory.mktemp("ckpt") / "plain.pth"
    torch.save({"model": model.state_dict(), "model_ema": model.state_dict(),
                "mar_probe_config": model.config.to_dict()}, path)
    return path


def _flat(tokens: torch.Tensor) -> np.ndarray:
    return tokens.flatten(2).transpose(1, 2).numpy()  # [B, C, H, W] -> [B, seq_len, C], as samples.npz


def test_sample_generate_record_and_compare_draw_the_same_tokens(plain_checkpoint, tmp_path, capsys):
    """On a checkpoint without recommended settings every entry point falls back to the same (official) settings:
    with the old CLI fallback (CFG 3.0 against the API's 1.0) generate and record drew other tokens."""
    model = load_model(plain_checkpoint)
    assert model.sampling_defaults == {}
    api = sample(model, [3, 5], num_iter=4, seed=7)
    assert api.settings["cfg"] == OFFICIAL["cfg"] and api.settings["temperature"] == OFFICIAL["temperature"]
    common = ["--checkpoint", str(plain_checkpoint), "--labels", "3,5", "--num-samples", "2", "--num-iter", "4",
              "--seed", "7"]
    assert main(["generate", *common, "--out", str(tmp_path / "gen")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "gen" / "samples.npz")["tokens"], _flat(api.tokens))

    # record draws each unit from a derived seed: one unit of both samples uses the first sample's seed
    unit_seed = int(sample_seeds(7, 2)[0])
    ref = sample(model, [3, 5], num_iter=4, seed=unit_seed)
    assert main(["record", *common, "--batch-size", "2", "--vars", "z", "--out", str(tmp_path / "r.zarr")]) == 0
    stored = open_run(tmp_path / "r.zarr")["tokens"].values[:, model.buffer_size:]  # [B, seq_len, C]
    np.testing.assert_array_equal(stored, _flat(ref.tokens))
    assert "uncond" not in open_run(tmp_path / "r.zarr")["branch"].values  # CFG 1.0: one branch

    res = compare(model, CompareConfig(runs=(), num_samples=2, labels=(3, 5), seeds=(7,), num_iter=4,
                                       grid_images=0), progress=False)
    np.testing.assert_array_equal(res.runs["full"][0].tokens, api.tokens.numpy())
    assert res.results["settings"]["cfg"] == OFFICIAL["cfg"] and res.results["settings"]["head_steps"] == "10"
    capsys.readouterr()


def test_recommended_settings_win_everywhere(plain_checkpoint, tmp_path):
    """With recommended settings in the file, the API and compare take them alike (compare's own temperature
    default of 1.0 used to override a checkpoint's recommended one)."""
    from mar_probe.models.checkpoints import write_sampling_defaults
    path = tmp_path / "rec.pth"
    path.write_bytes(plain_checkpoint.read_bytes())
    write_sampling_defaults(path, cfg=2.0, temperature=0.7, num_iter=3)
    model = load_model(path)
    api = sample(model, [1, 2], seed=2)
    assert (api.settings["cfg"], api.settings["temperature"], api.settings["num_iter"]) == (2.0, 0.7, 3)
    res = compare(model, CompareConfig(runs=(), num_samples=2, labels=(1, 2), seeds=(2,), grid_images=0),
                  progress=False)
    np.testing.assert_array_equal(res.runs["full"][0].tokens, api.tokens.numpy())
    assert res.results["settings"]["temperature"] == 0.7


def test_head_steps_are_applied_for_the_call_and_restored(plain_checkpoint):
    model = load_model(plain_checkpoint)
    assert model.diffloss.num_sampling_steps == "10"
    five = sample(model, [0], num_iter=2, seed=1, head_steps=5)
    assert five.settings["num_sampling_steps"] == "5" and model.diffloss.num_sampling_steps == "10"
    rebuilt = load_model(plain_checkpoint, num_sampling_steps=5)
    torch.testing.assert_close(sample(rebuilt, [0], num_iter=2, seed=1).tokens, five.tokens, rtol=0, atol=0)
    assert not torch.equal(sample(model, [0], num_iter=2, seed=1).tokens, five.tokens)


def test_resolve_fills_in_order_and_round_trips(tiny_model):
    assert not SamplingConfig().resolved
    full = SamplingConfig(cfg=2.5).resolve(tiny_model)
    assert full.resolved and full == SamplingConfig(num_iter=64, cfg=2.5, cfg_schedule="linear", temperature=1.0,
                                                    head_steps="10", rng="own")
    tiny_model.sampling_defaults = {"temperature": 0.6, "cfg": 3.0}
    assert SamplingConfig(cfg=2.5).resolve(tiny_model).temperature == 0.6  # recommended beats official
    assert SamplingConfig(cfg=2.5).resolve(tiny_model).cfg == 2.5            # given beats recommended
    assert SamplingConfig.from_dict(full.to_dict()) == full
    assert SamplingConfig(head_steps=50) == SamplingConfig(head_steps="50")
    assert full.replace(cfg=None, temperature=0.9) == SamplingConfig(**{**full.to_dict(), "temperature": 0.9})


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_iter=0), "num_iter must be a positive integer, got 0"),
    (dict(num_iter=True), "num_iter must be a positive integer, got True"),
    (dict(cfg=float("nan")), "cfg must be a finite number >= 1, got nan"),
    (dict(cfg=0.5), "cfg must be a finite number >= 1, got 0.5"),
    (dict(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
    (dict(cfg_schedule="cosine"), "unknown cfg_schedule 'cosine'; expected one of \\('linear', 'constant'\\)"),
    (dict(rng="numpy"), "unknown rng mode 'numpy'; expected one of \\('own', 'official', 'stepwise'\\)"),
    (dict(head_steps=" "), "head steps must be a count such as '100' or per-section counts such as '25,25', got ' '"),
    (dict(head_steps="ddim5"), "head steps must be a count such as '100'"),
])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_bad_resolution_and_mapping_are_named(tiny_model):
    with pytest.raises(ValueError, match="num_iter 65 exceeds the 64 tokens"):
        SamplingConfig(num_iter=65).resolve(tiny_model)
    with pytest.raises(ValueError, match=r"unknown SamplingConfig field\(s\) \['steps'\]"):
        SamplingConfig.from_dict({"steps": 3})
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, got 'dict'"):
        sample(tiny_model, [0], sampling={"cfg": 2.0})


def test_configs_take_their_sampling_fields_from_sampling_config_alone():
    """CompareConfig and StudyConfig hand every sampling field they hold to SamplingConfig (SamplingConfig.of), and
    resolving writes every one back: no field list repeated by hand (issue 18 item 2)."""
    from dataclasses import fields
    from mar_probe.compare import StrategyRun
    from mar_probe.study import StudyConfig
    given = dict(num_iter=6, cfg=2.5, cfg_schedule="constant", temperature=0.7, head_steps="25", rng="official")
    cmp = CompareConfig(runs=(StrategyRun(label="m", name="marche"),), **given)
    assert cmp.sampling == SamplingConfig(**given)
    resolved = cmp.resolved(perturbed_tiny())
    assert {f.name: getattr(resolved, f.name) for f in fields(SamplingConfig)} == given
    study = StudyConfig(num_iter=6, cfg=2.5, cfg_schedule="constant", temperature=0.7)
    assert study.sampling == SamplingConfig(num_iter=6, cfg=2.5, cfg_schedule="constant", temperature=0.7)
