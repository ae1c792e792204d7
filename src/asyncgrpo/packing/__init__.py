"""Tree packing (SPEC P1-P5): prefix-trie rows, the token-budget planner, tree attention backends.

The trainer converts each ``TrainingSequence`` into a :class:`PackSample`, feeds the planner,
packs each planned row with :func:`pack_trie`, switches the model to tree attention once
(:func:`use_tree_attention`) and runs ``packed_hidden_states(model, row.to(device), plan)``.
"""

from asyncgrpo.packing.attention import (
    TREE_ATTENTION,
    TreeAttentionPlan,
    build_plan,
    packed_hidden_states,
    register_tree_attention,
    resolve_backend,
    use_tree_attention,
)
from asyncgrpo.packing.planner import (
    CLOSE,
    GROUP_END,
    MicroBatch,
    PullMark,
    TokenBudgetBatcher,
    batch_metrics,
    plan_step,
)
from asyncgrpo.packing.row import PackedRow, pack_samples, pack_trie
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie

__all__ = [
    "CLOSE",
    "GROUP_END",
    "TREE_ATTENTION",
    "MicroBatch",
    "PackSample",
    "PackedRow",
    "PrefixTrie",
    "PullMark",
    "TokenBudgetBatcher",
    "TreeAttentionPlan",
    "batch_metrics",
    "build_plan",
    "pack_samples",
    "pack_trie",
    "packed_hidden_states",
    "plan_step",
    "register_tree_attention",
    "resolve_backend",
    "use_tree_attention",
]
