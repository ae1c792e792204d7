"""Model families that need handling of their own beyond ``AutoModelForCausalLM`` (vision-language checkpoints)."""
