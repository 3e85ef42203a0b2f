"""mar_probe: probe, measure and accelerate masked autoregressive (MAR) image generators."""
from ._version import __version__

from .api import SampleResult, decode_images, sample
from .models import MAR, MARConfig, PRESETS, preset_config
from .models.checkpoints import create_model, load_model
from .probe import SelectionSpec, record
from .store import open_run

__all__ = ["__version__", "MAR", "MARConfig", "PRESETS", "SampleResult", "create_model", "decode_images", "load_model",
           "open_run", "preset_config", "record", "sample", "SelectionSpec"]
