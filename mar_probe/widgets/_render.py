"""Matplotlib figures drawn off-screen (Agg) into PNG bytes for an ``ipywidgets.Image``: no backend, no JS."""
from __future__ import annotations

import io


def ipywidgets():
    """The ipywidgets module, or an ImportError saying how to install it."""
    try:
        import ipywidgets as W
    except ImportError as exc:
        raise ImportError("mar_probe.widgets needs ipywidgets; install the notebook extra: "
                          "pip install -e '.[notebooks]' (or pip install ipywidgets)") from exc
    return W


def blank_figure(figsize):
    """A pyplot-free figure (never shown by ``plt.show``, never kept in pyplot's registry), Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def new_figure(figsize, ncols: int = 1, nrows: int = 1, **kw):
    """A :func:`blank_figure` with a [nrows, ncols] array of axes."""
    fig = blank_figure(figsize)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def png_bytes(fig, dpi: int = 100) -> bytes:
    """The figure rendered as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def show_image(ax, image, **kw):
    """imshow of a uint8 [H, W, C] image (grey when C == 1) with no ticks; returns the AxesImage."""
    img = image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image
    ax.set(xticks=[], yticks=[])
    return ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=255, interpolation="nearest", **kw)
