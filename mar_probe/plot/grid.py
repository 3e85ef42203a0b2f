"""Image grids."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .._io import atomic_path


def image_grid(images: np.ndarray, ncols: int | None = None, pad: int = 2) -> np.ndarray:
    """Tile uint8 images [N, H, W, C] into one [rows*(H+pad), cols*(W+pad), C] array."""
    n, h, w, c = images.shape
    ncols = ncols or int(np.ceil(np.sqrt(n)))
    nrows = int(np.ceil(n / ncols))
    grid = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, ncols)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = img
    return grid


def save_image_grid(images: np.ndarray, path, labels=None, ncols: int | None = None, scale: int = 4) -> Path:
    """Save a PNG grid of uint8 images [N, H, W, C] (grayscale when C == 1), upscaled for viewing."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    grid = image_grid(images, ncols)
    grid = grid.repeat(scale, 0).repeat(scale, 1)
    path = Path(path)
    with atomic_path(path) as tmp:
        plt.imsave(tmp, grid[..., 0] if grid.shape[-1] == 1 else grid, cmap="gray" if grid.shape[-1] == 1 else None,
                   vmin=0, vmax=255, format=path.suffix.lstrip(".") or "png")
    return path
