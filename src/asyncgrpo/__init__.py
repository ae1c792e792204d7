"""asyncgrpo: asynchronous GRPO — a generation server streams rollouts while the trainer learns from them."""

__version__ = "0.1.0"

__all__ = ["__version__"]
