"""Ready assets and tasks: the offline demo model, tiny test models."""

from asyncgrpo.recipes.assets import cache_dir, demo_model_dir, smollm2_tokenizer, smollm2_tokenizer_dir
from asyncgrpo.recipes.tiny import TINY_ARCHS, tiny_config, tiny_model, tiny_model_dir

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
