"""sglang-eagle3: train, serve and benchmark EAGLE-3 draft models."""
__version__ = "0.1.0"
