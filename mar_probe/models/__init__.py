"""Models: MAR, its diffusion head, tokenizers, presets and checkpoints."""
from .config import MARConfig
from .mar import MAR
from .presets import DEFAULT_PRESET, PRESETS, preset_config

__all__ = ["MAR", "MARConfig", "PRESETS", "DEFAULT_PRESET", "preset_config"]
