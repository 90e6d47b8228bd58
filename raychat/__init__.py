"""raychat: pretrain nanochat-style GPT models on a Ray cluster."""

__version__ = "0.1.0"
