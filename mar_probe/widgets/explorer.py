"""``explore(ds)``: a recorded run by hand — cosine stability on the token grid beside the image being generated."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

from ..plot.lint import exempt_labels
from . import frames as F
from ._render import ipywidgets, new_figure, png_bytes, show_image

GENERATING_RGBA = (1.0, 0.15, 0.1, 0.5)
MASKED_RGBA = (0.3, 0.5, 1.0, 0.3)


def _open(ds):
    if isinstance(ds, (str, Path)):
        from ..store import open_run
        return open_run(ds)
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"expected an xarray.Dataset from mar_probe.open_run or a store path, "
                        f"got {type(ds).__name__!r}")
    return ds


def _default_pair(steps: list[int]) -> tuple[int, int]:
    """MARché's 4 -> 5 when stored, else the first adjacent pair, else the first two steps."""
    if 4 in steps and 5 in steps:
        return steps.index(4), steps.index(5)
    adjacent = [i for i in range(len(steps) - 1) if steps[i + 1] == steps[i] + 1]
    return (adjacent[0], adjacent[0] + 1) if adjacent else (0, 1)


def auto_floor(cos: np.ndarray, t_minus_1: np.ndarray) -> float:
    """The colour floor of a cosine map: min(1st percentile of its finite values, lowest finite value where
    ``t_minus_1`` (the tokens decoded between the two steps)), rounded down to 0.001, in [-1, 0.999] (0.9 for
    an empty map)."""
    finite = np.isfinite(cos)
    if not finite.any():
        return 0.9
    floor = np.percentile(cos[finite], 1)
    if (finite & t_minus_1).any():
        floor = min(floor, cos[finite & t_minus_1].min())
    return float(np.clip(np.floor(floor * 1000) / 1000, -1.0, 0.999))


class Explorer:
    """Cosine stability of a recorded variable on the token grid, beside the image the model holds at that step.

    Controls: variable, layer, step pair (s0, s1), CFG branch, sample, and the floor of the colour scale (set at
    start, and on a new variable, to the lower of the map's 1st percentile and its lowest token decoded between
    s0 and s1: those (t-1 for adjacent steps) change most and never saturate, and one outlier elsewhere does not
    flatten the scale). The left
    panel is the cosine of each image token's vector between steps s0 and s1 (grey: not processed at one of
    them); the right panel is the canvas after step s1, decoded from the store's tokens and masks (still-masked
    tokens are zeros, as the model has them, tinted blue), with the tokens generated at s1 in red. Works on the
    store alone; no model is loaded.

    Attributes
    ----------
    controls : dict of ipywidgets
        ``var``, ``layer``, ``steps``, ``branch``, ``sample``, ``floor``; set their ``value`` to drive it.
    fig : matplotlib.figure.Figure
        The figure; ``map_artist``, ``image_artist`` and ``overlay_artist`` are its AxesImages.
    widget : ipywidgets.Box
        What a notebook displays (``display(explorer)`` works too).
    """

    def __init__(self, ds, *, var: str | None = None, sample: int | None = None, dpi: int = 90):
        self.ds = _open(ds)
        for need in ("mask", "pred", "tokens", "row"):
            if need not in self.ds.variables:
                raise ValueError(f"the store lacks {need!r}; expected a run written by `mar-probe record`")
        self.variables = F.vector_variables(self.ds)
        if not self.variables:
            raise ValueError("the store has no per-step vector variable to compare between steps; record one, e.g. "
                             "`mar-probe record --vars dec_k,dec_v,z`")
        self.steps = [int(s) for s in self.ds["step"].values]
        if len(self.steps) < 2:
            raise ValueError(f"need at least two recorded steps for a step pair, got steps {self.steps!r}")
        self.dpi = dpi
        self._hold = False
        self.controls = self._build_controls(var or self.variables[0], sample)
        self._build_figure()
        self._build_widget()
        self._sync_var_controls()
        self._auto_floor()
        self.update()

    # ---- construction -----------------------------------------------------------------------------
    def _build_controls(self, var: str, sample) -> dict:
        W = ipywidgets()
        if var not in self.variables:
            raise ValueError(f"unknown variable {var!r}; expected one of {self.variables!r}")
        samples = [int(s) for s in self.ds["sample"].values]
        labels = self.ds["label"].values if "label" in self.ds.coords else [None] * len(samples)
        opts = [(f"{s} (label {int(lab)})" if lab is not None else str(s), s) for s, lab in zip(samples, labels)]
        lo, hi = _default_pair(self.steps)
        style = {"description_width": "70px"}
        c = {"var": W.Dropdown(options=self.variables, value=var, description="variable", style=style),
             "layer": W.Dropdown(options=[], description="layer", style=style),
             "steps": W.SelectionRangeSlider(options=[(str(s), s) for s in self.steps], index=(lo, hi),
                                             description="steps", style=style, continuous_update=False),
             "branch": W.Dropdown(options=[str(b) for b in self.ds["branch"].values] or ["cond"],
                                  description="branch", style=style),
             "sample": W.Dropdown(options=opts, value=samples[0] if sample is None else sample,
                                  description="sample", style=style),
             "floor": W.FloatSlider(min=-1.0, max=0.999, step=0.001, value=0.9, readout_format=".3f",
                                    description="cos floor", style=style, continuous_update=False)}
        c["var"].observe(self._on_var, names="value")
        for name in ("layer", "steps", "branch", "sample", "floor"):
            c[name].observe(self._on_change, names="value")
        return c

    def _build_figure(self) -> None:
        import matplotlib.ticker
        self.fig, axes = new_figure((8.6, 4.0), ncols=2)
        self.ax_map, self.ax_img = axes[0]
        grid = F.image_token_grid(self.ds, np.zeros(self.ds.sizes["token"]))
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.75")
        self.map_artist = self.ax_map.imshow(grid, cmap=cmap, vmin=0.9, vmax=1.0, interpolation="nearest")
        self.fig.colorbar(self.map_artist, ax=self.ax_map, label="cosine similarity", shrink=0.85, extend="min")
        self.ax_map.set(xlabel="token column", ylabel="token row")
        self.ax_map.grid(False)
        for axis in (self.ax_map.xaxis, self.ax_map.yaxis):
            axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        first = F.partial_image(self.ds, int(self.ds["sample"].values[0]), self.steps[0])
        self.image_artist = show_image(self.ax_img, np.zeros_like(first))
        self.overlay_artist = self.ax_img.imshow(np.zeros(first.shape[:2] + (4,)), interpolation="nearest")
        self.ax_img.grid(False)
        exempt_labels(self.ax_img, "the image being generated")

    def _build_widget(self) -> None:
        W = ipywidgets()
        self.image = W.Image(format="png", layout=W.Layout(max_width="820px"))
        self.status = W.HTML()
        box = W.VBox([self.controls[k] for k in ("var", "layer", "steps", "branch", "sample", "floor")]
                     + [self.status],
                     layout=W.Layout(min_width="330px"))
        self.widget = W.HBox([box, self.image])

    # ---- reactions ----------------------------------------------------------------------------------
    def _sync_var_controls(self) -> None:
        """Layer options and branch availability follow the chosen variable."""
        x = self.ds[self.controls["var"].value]
        ldim = F.layer_dim(x)
        layer = self.controls["layer"]
        self._hold = True
        try:
            old = layer.value
            layer.options = [int(v) for v in x[ldim].values] if ldim else []
            layer.disabled = ldim is None
            if ldim:
                layer.value = old if old in layer.options else layer.options[min(1, len(layer.options) - 1)]
            self.controls["branch"].disabled = "branch" not in x.dims
        finally:
            self._hold = False

    def _auto_floor(self) -> None:
        """Floor of the colour scale: the lower of the map's 1st percentile and the lowest cosine of the tokens
        decoded between s0 and s1 (for adjacent steps: t-1), rounded down to the slider's 0.001, in [-1, 0.999]."""
        s = self.state()
        cos = F.cosine_map(self.ds, s["var"], s["sample"], s["steps"], s["layer"], s["branch"])
        mask = self.ds["mask"].sel(sample=s["sample"])
        decoded = mask.sel(step=s["steps"][0]).values & ~mask.sel(step=s["steps"][1]).values  # unknown -> known
        floor = auto_floor(cos, F.image_token_grid(self.ds, decoded) > 0)
        self._hold = True
        try:
            self.controls["floor"].value = floor
        finally:
            self._hold = False

    def _on_var(self, change) -> None:
        self._sync_var_controls()
        self._auto_floor()
        self.update()

    def _on_change(self, change) -> None:
        if not self._hold:
            self.update()

    def state(self) -> dict:
        """The current selection: var, layer, steps (s0, s1), branch, sample."""
        c = self.controls
        return {"var": c["var"].value, "layer": c["layer"].value if not c["layer"].disabled else None,
                "steps": tuple(int(s) for s in c["steps"].value),
                "branch": c["branch"].value if not c["branch"].disabled else None, "sample": c["sample"].value}

    def update(self) -> None:
        """Recompute both panels for the current selection and re-render the figure."""
        s = self.state()
        (s0, s1) = s["steps"]
        if s0 == s1:
            self.status.value = "<b>pick two different steps</b>"
            return
        cos = F.cosine_map(self.ds, s["var"], s["sample"], (s0, s1), s["layer"], s["branch"])
        self.map_artist.set_data(cos)
        self.map_artist.set_clim(self.controls["floor"].value, 1.0)
        where = ", ".join(f"{k} {s[k]}" for k in ("layer", "branch") if s[k] is not None)
        self.ax_map.set_title(f"{s['var']} cosine, step {s0}→{s1}" + (f"\n{where}" if where else ""), fontsize=10)
        self._draw_canvas(s["sample"], s1)
        self.status.value = self._summary(cos, s["sample"], s1)
        self.image.value = png_bytes(self.fig, self.dpi)

    def _draw_canvas(self, sample: int, step: int) -> None:
        img = F.partial_image(self.ds, sample, step)
        known, gen = F.known_after(self.ds, sample, step)
        self.image_artist.set_data(img[..., 0] if img.shape[-1] == 1 else img)
        cover = F.upsample_token_mask(gen, self.ds.attrs["model_config"], img.shape[:2])
        masked = F.upsample_token_mask(~known, self.ds.attrs["model_config"], img.shape[:2])
        overlay = np.zeros(img.shape[:2] + (4,))
        overlay[masked] = MASKED_RGBA
        overlay[cover] = GENERATING_RGBA
        self.overlay_artist.set_data(overlay)
        self.ax_img.set_title(f"canvas after step {step}: {int(known.sum())}/{known.size} tokens known\n"
                              f"red: {int(gen.sum())} generated at step {step}; blue: still masked", fontsize=10)

    def _summary(self, cos: np.ndarray, sample: int, step: int) -> str:
        finite = cos[np.isfinite(cos)]
        if not finite.size:
            return "no token was processed at both steps"
        label = int(self.ds["label"].sel(sample=sample)) if "label" in self.ds.coords else "?"
        return (f"sample {sample}, label {label}<br>mean cosine {finite.mean():.4f} over {finite.size} tokens<br>"
                f"share &gt; 0.95: {(finite > 0.95).mean():.1%}, &gt; 0.99: {(finite > 0.99).mean():.1%}")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def explore(ds, **kwargs) -> Explorer:
    """Explore a recorded run: cosine stability on the token grid beside the image generated at that step.

    Parameters
    ----------
    ds : xarray.Dataset or str or Path
        A run from :func:`mar_probe.open_run`, or the store's path.
    var : str, optional
        Initial variable (default: the first recorded per-step vector variable).
    sample : int, optional
        Initial sample.
    dpi : int
        Resolution of the rendered figure.

    Returns
    -------
    Explorer
        Display it in a notebook; drive it through ``explorer.controls[name].value``.
    """
    return Explorer(ds, **kwargs)
