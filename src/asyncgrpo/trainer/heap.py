"""The trainer's long-lived heap kept out of the garbage collector's full scans while ``train()`` runs.

Why: after its construction and compile warm-up a trainer process holds about 600 k tracked objects (torch,
transformers, the model's modules, dynamo's caches); one full collection walks them all, 0.25 s on a CPU machine.
transformers' training loop starts with one (``accelerator.free_memory()``: ``gc.collect()``), on the path to the
first step, and the interpreter runs more at random as a run allocates: each is a step that takes a quarter
second longer. ``gc.freeze()`` moves what exists into the permanent generation, which collections skip (as vLLM
and our server's engine do after their start); the few thousand unreachable objects already there (cycles left by
the compile warm-up, a few MB) stay until the end of ``train()``, when ``gc.unfreeze()`` hands everything back.
A process that froze its heap itself is left as it is: a permanent generation larger than at this module's import.
Not merely non-empty: Python 3.12 starts with a few hundred objects there (375 on 3.12.1; 3.11 and 3.13 with none),
and on the GPU machine's 3.12 the heap was never frozen (its first ``gc.collect()``: 0.2 s before step 1).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_PERMANENT_AT_IMPORT = gc.get_freeze_count()  # what the interpreter put there itself (see the module docstring)


@contextlib.contextmanager
def frozen_heap() -> Iterator[bool]:
    """Freeze the heap for the block (unfrozen after it); yields whether this call froze it."""
    if gc.get_freeze_count() > _PERMANENT_AT_IMPORT:  # frozen already: the owner of that freeze decides when it ends
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
