"""mar_probe: probe, measure and accelerate masked autoregressive (MAR) image generators."""
__version__ = "0.1.0"
