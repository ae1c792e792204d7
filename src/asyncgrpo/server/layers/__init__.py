"""Building blocks of the compact forward: paged attention and the Triton kernels.

``attention.py`` chooses between the kernels and torch's own attention; ``decode_kernel.py`` and
``prefill_kernel.py`` are the paged attention kernels, ``fused.py`` the fused element-wise steps (norms, RoPE,
activations) and ``sample_kernel.py`` the sampling kernel the engine's sampler launches. They know nothing of
requests or scheduling. Only the Triton programs import Triton (``decode_kernel``, ``prefill_kernel``,
``fused_triton``, ``sample_triton``), and only on the first CUDA use (``asyncgrpo/triton_support.py``).
"""
