"""Synthetic samples with GRPO's sharing structure, for benchmarks and tests of packers.

Random token ids: packing, attention and speed do not depend on what the tokens mean.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.packing.sample import PackSample


def grpo_samples(
    num_groups: int,
    group_size: int,
    prompt_len: int,
    completion_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    system_len: int = 0,
) -> list[PackSample]:
    """``num_groups`` prompts of ``prompt_len`` tokens, each with ``group_size`` completions.

    Completion lengths are uniform in ``completion_len`` (inclusive); the first ``system_len``
    prompt tokens are the same in every group (a shared system prompt). Prompt tokens are
    untrained, completion tokens trained; advantages are centred within each group.
    """
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, size=system_len)
    out: list[PackSample] = []
    for g in range(num_groups):
        prompt = np.concatenate([system, rng.integers(0, vocab_size, size=prompt_len - system_len)])
        adv = rng.standard_normal(group_size)
        adv = (adv - adv.mean()) / max(adv.std(), 1e-6)
        for i in range(group_size):
            n = int(rng.integers(completion_len[0], completion_len[1] + 1))
            ids = np.concatenate([prompt, rng.integers(0, vocab_size, size=n)])
            mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(n, bool)])
            old = np.where(mask, -rng.exponential(1.0, size=len(ids)), 0.0)
            out.append(PackSample(ids, mask, old, float(adv[i]), group_id=g))
    return out


def random_tree_samples(rng: np.random.Generator, vocab_size: int = 64, num_groups: int = 3) -> list[PackSample]:
    """Samples that exercise every trie case, for parity tests.

    Several groups under a shared system prompt (multi-level sharing); completions drawn
    from a 3-symbol alphabet so they share prefixes of their own and branch into
    single-token segments; a multi-turn continuation (earlier turn untrained, tool
    result untrained, new turn trained); a sample that is a prefix of another; an exact
    duplicate; a one-token completion.
    """
    system = list(rng.integers(0, vocab_size, size=int(rng.integers(2, 6))))
    out: list[PackSample] = []

    def add(ids: list[int], mask: list[int], group: int) -> PackSample:
        old = [float(-rng.exponential()) if m else 0.0 for m in mask]
        s = PackSample(ids, mask, old, float(rng.standard_normal()), group_id=group)
        out.append(s)
        return s

    for g in range(num_groups):
        prompt = system + list(rng.integers(0, vocab_size, size=int(rng.integers(1, 6))))
        alphabet = rng.choice(vocab_size, size=3, replace=False)
        for _ in range(int(rng.integers(2, 5))):
            comp = list(rng.choice(alphabet, size=int(rng.integers(1, 7))))
            add(prompt + comp, [0] * len(prompt) + [1] * len(comp), g)
    base = out[0]  # at least 4 tokens: system >= 2, question >= 1, completion >= 1
    ids0, mask0 = list(base.token_ids), list(base.loss_mask.astype(int))
    add(ids0[:-1], mask0[:-1], 0)  # a prefix of another sample
    tool = list(rng.integers(0, vocab_size, size=3))
    turn = list(rng.integers(0, vocab_size, size=4))
    multi = add(ids0 + tool + turn, [0] * (len(ids0) + len(tool)) + [1] * len(turn), 0)
    add(ids0, mask0, 0)  # an exact duplicate
    # a one-token turn forking inside the tool result of the multi-turn sample
    fork = list(multi.token_ids[: len(ids0) + 2])
    add(fork + [int(rng.integers(0, vocab_size))], [0] * len(fork) + [1], 0)
    return out
