"""KL-16 VAE: official parameter names/shapes, checkpoint loading, token decoding, pinned outputs.

``data/kl16_state_dict_shapes.json`` lists ``{key: shape}`` of the official ``AutoencoderKL(embed_dim=16,
ch_mult=(1, 1, 2, 2, 4))`` from LTH14/mar ``models/vae.py``, dumped from the official module.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mar_probe.models.vae import (MAR_LATENT_SCALE, AutoencoderKL, DiagonalGaussian, KL16Decoder, VAEConfig,
                                  load_vae, to_uint8)

MANIFEST = Path(__file__).parent / "data" / "kl16_state_dict_shapes.json"
# Small but complete: attention in the encoder's last level and in the decoder's level 1.
SMALL = VAEConfig(ch=32, ch_mult=(1, 2, 2), resolution=64, dec_attn_resolutions=(32,))


def _small_vae(seed=0):
    torch.manual_seed(seed)
    return AutoencoderKL(SMALL).eval()


def _save(tmp_path, state, name="vae.ckpt"):
    path = tmp_path / name
    torch.save(state, path)
    return path


def test_state_dict_matches_official_kl16():
    expected = json.loads(MANIFEST.read_text())
    got = {k: list(v.shape) for k, v in AutoencoderKL().state_dict().items()}
    assert sorted(set(got) ^ set(expected)) == []
    assert got == expected
    assert sum(int(np.prod(s)) for s in got.values()) == 66_456_019


def test_checkpoint_round_trip(tmp_path):
    vae = _small_vae()
    z = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = vae.decode(z)
    for state in ({"model": vae.state_dict()}, vae.state_dict()):
        loaded = load_vae(_save(tmp_path, state), config=SMALL)
        assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
        with torch.no_grad():
            assert torch.equal(loaded.decode(z), ref)


def test_missing_checkpoint_names_path_and_source(tmp_path):
    path = tmp_path / "nope" / "kl16.ckpt"
    with pytest.raises(FileNotFoundError) as err:
        load_vae(path)
    assert str(path) in str(err.value) and "kl16.ckpt released with MAR" in str(err.value)


def test_wrong_keys_and_shapes_are_listed(tmp_path):
    sd = _small_vae().state_dict()
    sd["extra.weight"] = sd.pop("decoder.conv_out.bias")
    sd["quant_conv.weight"] = torch.zeros(3, 3, 1, 1)
    with pytest.raises(ValueError) as err:
        load_vae(_save(tmp_path, {"model": sd}), config=SMALL)
    msg = str(err.value)
    assert "missing keys (1): ['decoder.conv_out.bias']" in msg
    assert "unexpected keys (1): ['extra.weight']" in msg
    assert "quant_conv.weight: checkpoint (3, 3, 1, 1) vs model (32, 32, 1, 1)" in msg


def test_full_size_checkpoint_must_match_kl16(tmp_path):
    with pytest.raises(ValueError, match="shape conflicts"):
        load_vae(_save(tmp_path, {"model": _small_vae().state_dict()}))


def test_shapes_encode_decode():
    vae = _small_vae()
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        post = vae.encode(x)
        assert post.parameters.shape == (2, 32, 4, 4) and post.mode().shape == (2, 16, 4, 4)
        assert vae.decode(post.mode()).shape == (2, 3, 16, 16)
        assert torch.equal(vae(x), vae.decode(post.mode()))


def test_posterior_sample_and_kl():
    moments = torch.cat([torch.ones(1, 2, 3, 3), torch.full((1, 2, 3, 3), -50.0)], dim=1)  # [B, 2z, h, w]
    post = DiagonalGaussian(moments)
    assert torch.equal(post.logvar, torch.full((1, 2, 3, 3), -30.0))  # clamped
    a = post.sample(torch.Generator().manual_seed(3))
    assert torch.equal(a, post.sample(torch.Generator().manual_seed(3)))
    assert torch.allclose(a, post.mode(), atol=1e-6)
    zero = DiagonalGaussian(torch.zeros(2, 4, 3, 3))
    assert torch.equal(zero.kl(), torch.zeros(2))
    assert torch.equal(DiagonalGaussian(moments, deterministic=True).sample(), post.mode())


def test_to_uint8_matches_mar_engine_conversion():
    x = torch.tensor([-2.0, -1.0, 0.0, 0.3, 1.0, 1.5]).reshape(1, 1, 2, 3).expand(1, 3, 2, 3)  # [B, C, H, W]
    got = to_uint8(x)
    assert got.dtype == np.uint8 and got.shape == (1, 2, 3, 3)
    assert got[0, :, :, 0].ravel().tolist() == [0, 0, 128, 166, 255, 255]


def test_kl16_decoder_scales_tokens():
    vae = _small_vae()
    tokens = torch.randn(2, 16, 2, 2, generator=torch.Generator().manual_seed(4))
    images = KL16Decoder(vae).decode_tokens(tokens)
    assert MAR_LATENT_SCALE == 0.2325 and images.dtype == np.uint8 and images.shape == (2, 8, 8, 3)
    with torch.no_grad():
        raw = (vae.decode(tokens / 0.2325) + 1) / 2  # as MAR's evaluate(), without the BGR flip for cv2
    expected = np.round(np.clip(raw.numpy().transpose([0, 2, 3, 1]) * 255, 0, 255)).astype(np.uint8)
    np.testing.assert_array_equal(images, expected)


def test_golden_decode_values():
    # Values from this implementation; the same weights in the official Encoder/Decoder differ by < 3e-6.
    z = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = _small_vae(seed=0).decode(z)
    assert out.shape == (1, 3, 16, 16)
    expected = torch.tensor([0.24228308, -0.05891925, -0.04099286, -0.32970244])
    got = torch.cat([out[0, :, 0, 0], out[0, 2, 7, 9].reshape(1)])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert out.mean().item() == pytest.approx(-0.0233868, abs=1e-5)
    assert out.std().item() == pytest.approx(0.3002090, abs=1e-5)
