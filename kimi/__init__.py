"""kimi: pretraining Kimi-style hybrid linear-attention models."""
__version__ = "0.1.0"
