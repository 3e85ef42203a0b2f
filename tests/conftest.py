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
