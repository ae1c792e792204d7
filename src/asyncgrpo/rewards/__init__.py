"""Built-in reward functions (R6): module-level, so they pickle into the rollout worker."""

from asyncgrpo.rewards.accuracy import accuracy_reward

__all__ = ["accuracy_reward"]
