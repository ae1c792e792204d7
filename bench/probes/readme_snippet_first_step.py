"""The README's training snippet, timed to its first optimizer step (issue 41, CPU).

    asyncgrpo serve demo --port 8011 --max-model-len 512 &
    python bench/probes/readme_snippet_first_step.py $(date +%s.%N) OUT_DIR

argv[1] is the caller's start stamp (the caller subtracts it from OUT_DIR/metrics.jsonl's first step "time");
argv[2] the output folder. Result of issue 41: bench/results/readme_snippet_cpu.json.
"""

import sys

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import demo_model_dir
from asyncgrpo.tasks.reasoning import numeric_answer_reward, reasoning_gym_dataset

if __name__ == "__main__":  # the README's snippet, max_steps 2, on port 8011
    model = str(demo_model_dir())
    dataset = reasoning_gym_dataset("chain_sum", size=512, min_terms=2, max_terms=2, max_digits=1)
    args = AsyncGRPOConfig(
        output_dir=sys.argv[2], max_steps=2, vllm_server_base_url="http://localhost:8011",
        num_generations=8, learning_rate=3e-5, max_staleness=4, compact_log=True,
        max_completion_length=32, token_budget=512, gradient_checkpointing=False, report_to=[],
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(model, reward_funcs=[numeric_answer_reward], args=args, train_dataset=dataset)
    trainer.train()
