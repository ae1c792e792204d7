"""A user script WITHOUT the ``if __name__ == "__main__":`` guard (item 11): it must fail fast with the hint.

python unguarded.py SERVER_URL MODEL_DIR OUTPUT_DIR
"""

import sys

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset


def length_reward(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


url, model_dir, output_dir = sys.argv[1:4]
dataset = reasoning_gym_dataset("chain_sum", size=8, seed=0, system_prompt=None)
args = AsyncGRPOConfig(output_dir=output_dir, max_steps=1, num_generations=2, max_completion_length=4,
                       vllm_server_base_url=url, report_to=[], save_strategy="no", gradient_checkpointing=False,
                       vllm_server_timeout=60, rollout_worker_timeout=60)  # fmt: skip
trainer = AsyncGRPOTrainer(model_dir, reward_funcs=[length_reward], args=args, train_dataset=dataset)
trainer.train()
