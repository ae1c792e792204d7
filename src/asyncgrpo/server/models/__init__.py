"""The forwards the engine runs: what turns a flat batch of tokens into logits.

``decoder.py`` is our compact decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache, ``hf.py`` the
general path through a Hugging Face model's own forward (every other family), and ``forward_batch.py`` the
per-step metadata (positions, slots, block tables) a forward and its attention read.
"""
