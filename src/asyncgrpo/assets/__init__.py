"""Offline assets: the demo model and its tokenizer, tiny random test models, the supervised tool warm-up."""

from asyncgrpo.assets.demo_model import cache_dir, demo_model_dir, smollm2_tokenizer, smollm2_tokenizer_dir
from asyncgrpo.assets.tiny import TINY_ARCHS, tiny_config, tiny_model, tiny_model_dir

__all__ = [
    "TINY_ARCHS",
    "cache_dir",
    "demo_model_dir",
    "smollm2_tokenizer",
    "smollm2_tokenizer_dir",
    "tiny_config",
    "tiny_model",
    "tiny_model_dir",
]
