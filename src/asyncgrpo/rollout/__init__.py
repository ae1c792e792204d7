"""The rollout worker: sampling, tool turns, rewards and advantages, grouped rollouts for the trainer."""
