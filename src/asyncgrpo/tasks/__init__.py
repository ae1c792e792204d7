"""Tasks and their rewards: reasoning-gym datasets, the built-in reward functions (R6) and held-out evaluation.

Reward functions are module-level, so they pickle into the rollout worker; a run's YAML names them by import path
(``asyncgrpo.tasks.reasoning:numeric_answer_reward``). ``tasks.evaluate`` is imported on its own (it needs the client).
"""

from asyncgrpo.tasks.accuracy import accuracy_reward
from asyncgrpo.tasks.reasoning import format_reward, numeric_answer_reward, reasoning_gym_dataset, reasoning_gym_reward

__all__ = ["accuracy_reward", "format_reward", "numeric_answer_reward", "reasoning_gym_dataset", "reasoning_gym_reward"]
