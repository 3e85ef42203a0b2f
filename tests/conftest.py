import numpy as np
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    from mar_probe import create_model
    return create_model("mar_tiny").eval()


@pytest.fixture
def trained_like_tiny(tiny_model):
    """mar_tiny with non-trivial random weights (the zero-initialised head would output constants)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return tiny_model


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def perturbed_tiny(seed: int = 1, scale: float = 0.05, **overrides):
    """mar_tiny (with config overrides) whose parameters get seeded noise (see create_perturbed_model)."""
    from mar_probe.models.checkpoints import create_perturbed_model
    return create_perturbed_model("mar_tiny", seed=seed, scale=scale, **overrides)


@pytest.fixture(scope="session")
def deep_tiny():
    """mar_tiny with enough layers for every cache (encoder 4, decoder 5, head 5) and non-trivial weights."""
    return perturbed_tiny(encoder_depth=4, decoder_depth=5, diffloss_d=5)
