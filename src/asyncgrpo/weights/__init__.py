"""Weight sync from trainer to servers: NCCL/gloo broadcast, CUDA IPC, LoRA adapters."""
