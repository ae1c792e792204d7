"""Prefix trie of a row's samples, laid out depth-first.

Samples that share a prefix (a group's prompt, a system prompt shared across
groups, the earlier turns of a conversation) forward it once. The trie is a
radix trie: each node holds a run of tokens. One rule bends the plain trie: a
position predicts one token, so when a node's last token is followed by two or
more *trained* tokens (the first tokens of two completions of one prompt), that
last token is forwarded once per such child (the worked
example of docs/design.md, "Packing": ``p3`` is not shared because it predicts ``a1`` or ``b1``). Children
whose first token is not trained hang under the first copy.

Layout (``PrefixTrie.layout``): tokens in depth-first order, each child after
its parent, so a token's ancestors all precede it and the subtree of token i
is the contiguous range ``[i, subtree_end[i])``. Key k is visible to query q
iff ``k <= q < subtree_end[k]``: causal attention restricted to the path.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from asyncgrpo.packing.sample import PackSample


class _Node:
    """A run of tokens; ``trained[j]`` is True when some sample trains ``tokens[j]``."""

    __slots__ = ("children", "tokens", "trained")

    def __init__(self, tokens: np.ndarray, trained: np.ndarray) -> None:
        self.tokens = tokens
        self.trained = trained
        self.children: dict[int, _Node] = {}  # first token -> child, in insertion (= layout) order

    def trained_children(self) -> int:
        return sum(1 for c in self.children.values() if c.trained[0])


def _extra_copies(num_trained_children: int) -> int:
    """Extra forwarded copies of a node's last token: one per trained child beyond the first."""
    return max(0, num_trained_children - 1)


def _depth_cost(start: int, stop: int) -> int:
    """Attention cost of tokens at depths start..stop-1: a token at depth d attends to d + 1 keys."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


@dataclass
class Layout:
    """Depth-first token layout of a trie (all arrays are int64, length T unless noted).

    Attributes:
        input_ids: token of each row position.
        position_ids: depth of each position in the trie (its position in its own sample).
        parent: row index of the previous token on the path, -1 for roots.
        subtree_end: exclusive end of each position's subtree.
        sample_index: per sample (in insertion order), [L] row index of each of its tokens.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    parent: np.ndarray
    subtree_end: np.ndarray
    sample_index: list[np.ndarray]


class PrefixTrie:
    """The samples of one row, merged on shared prefixes.

    Args:
        share_prefixes: False packs each sample as its own chain (plain padding-free
            packing, the baseline tree packing is measured against).
    """

    def __init__(self, share_prefixes: bool = True) -> None:
        self.share_prefixes = share_prefixes
        self._root = _Node(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
        self.samples: list[PackSample] = []
        self.group_ids: set[Hashable] = set()
        self.num_tokens = 0  # forwarded tokens (shared ones once, copies included)
        self.attention_cost = 0  # sum over forwarded tokens of the keys each attends to
        self.num_flat_tokens = 0  # sum of sample lengths (what flat packing would forward)
        self.num_trained = 0  # trained tokens over all samples

    def __len__(self) -> int:
        return len(self.samples)

    # ------------------------------------------------------------------ insertion
    def cost_of(self, sample: PackSample) -> tuple[int, int]:
        """(new forwarded tokens, new attention cost) if ``sample`` were inserted; changes nothing."""
        return self._walk(sample, commit=False)

    def insert(self, sample: PackSample) -> tuple[int, int]:
        """Insert ``sample``; returns the forwarded tokens and attention cost it added."""
        tokens, cost = self._walk(sample, commit=True)
        self.samples.append(sample)
        self.group_ids.add(sample.group_id)
        self.num_tokens += tokens
        self.attention_cost += cost
        self.num_flat_tokens += len(sample)
        self.num_trained += sample.num_trained
        return tokens, cost

    def _walk(self, sample: PackSample, commit: bool) -> tuple[int, int]:
        ids, trained = sample.token_ids, sample.loss_mask
        n_ids = len(ids)
        if not self.share_prefixes:
            if commit:  # negative keys never match a token id: every sample is its own root chain
                self._root.children[-1 - len(self.samples)] = _Node(ids.copy(), trained.copy())
            return n_ids, _depth_cost(0, n_ids)
        tokens = cost = 0
        node, pos = self._root, 0
        while pos < n_ids:
            is_root = node is self._root
            child = node.children.get(int(ids[pos]))
            if child is None:  # branch off after the node's last token
                tc = node.trained_children()
                copies = 0 if is_root else _extra_copies(tc + int(trained[pos])) - _extra_copies(tc)
                if commit:
                    node.children[int(ids[pos])] = _Node(ids[pos:].copy(), trained[pos:].copy())
                return tokens + n_ids - pos + copies, cost + _depth_cost(pos, n_ids) + copies * pos
            if trained[pos] and not child.trained[0] and not is_root:  # child becomes a trained branch
                tc = node.trained_children()
                copies = _extra_copies(tc + 1) - _extra_copies(tc)
                tokens, cost = tokens + copies, cost + copies * pos
            run = child.tokens
            k = min(len(run), n_ids - pos)
            diff = np.flatnonzero(run[:k] != ids[pos : pos + k])
            m = int(diff[0]) if len(diff) else k
            if m == len(run) or pos + m == n_ids:  # run fully matched, or the sample ends inside it
                if commit:
                    child.trained[:m] |= trained[pos : pos + m]
                node, pos = child, pos + m
                continue
            # diverge inside the run at offset m >= 1: split into upper run[:m] and lower run[m:]
            depth = pos + m
            copies = _extra_copies(int(child.trained[m]) + int(trained[depth]))
            if commit:
                lower = _Node(run[m:], child.trained[m:])
                lower.children = child.children
                fresh = _Node(ids[depth:].copy(), trained[depth:].copy())
                child.tokens, child.trained = run[:m], child.trained[:m] | trained[pos:depth]
                child.children = {int(run[m]): lower, int(ids[depth]): fresh}
            return tokens + n_ids - depth + copies, cost + _depth_cost(depth, n_ids) + copies * depth
        return tokens, cost

    # ------------------------------------------------------------------ layout
    def layout(self) -> Layout:
        """Lay the trie out depth-first and map every sample token to its row index."""
        ids_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        par_parts: list[np.ndarray] = []
        pieces: list[tuple[int, int, int, int]] = []  # (start, stop, first depth, last depth)
        node_start: dict[int, int] = {}  # id(node) -> row index of its first (non-copied) token
        copy_for_child: dict[int, int] = {}  # id(child) -> row index of the copy it hangs under
        first_copy: dict[int, int] = {}  # id(node) -> row index of its first copy
        cursor = 0

        def emit(tokens: np.ndarray, parent: int, depth: int) -> int:
            nonlocal cursor
            n = len(tokens)
            ids_parts.append(tokens)
            pos_parts.append(np.arange(depth, depth + n, dtype=np.int64))
            par = np.arange(cursor - 1, cursor + n - 1, dtype=np.int64)
            par[0] = parent
            par_parts.append(par)
            pieces.append((cursor, cursor + n, depth, depth + n - 1))
            cursor += n
            return cursor - 1  # row index of the last emitted token

        # stack items: (node, parent row index, depth) or (None, parent, depth, node, group, is_first) for a copy
        stack: list[tuple] = [(c, -1, 0) for c in reversed(self._root.children.values())]
        while stack:
            item = stack.pop()
            if item[0] is None:  # a copy of `owner`'s last token, heading `group`
                _, parent, depth, owner, group, is_first = item
                last = emit(owner.tokens[-1:], parent, depth)
                for c in group:
                    copy_for_child[id(c)] = last
                if is_first:
                    first_copy[id(owner)] = last
                stack.extend((c, last, depth + 1) for c in reversed(group))
                continue
            nd, parent, depth = item
            n = len(nd.tokens)
            copied = nd.trained_children() >= 2
            body = n - 1 if copied else n
            node_start[id(nd)] = cursor
            last = emit(nd.tokens[:body], parent, depth) if body else parent
            if not copied:
                stack.extend((c, last, depth + n) for c in reversed(nd.children.values()))
                continue
            children = list(nd.children.values())
            trained = [c for c in children if c.trained[0]]
            groups = [[c for c in children if c is trained[0] or not c.trained[0]]] + [[c] for c in trained[1:]]
            stack.extend((None, last, depth + n - 1, nd, g, i == 0) for i, g in reversed(list(enumerate(groups))))

        input_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
        position_ids = np.concatenate(pos_parts) if pos_parts else np.zeros(0, dtype=np.int64)
        parent = np.concatenate(par_parts) if par_parts else np.zeros(0, dtype=np.int64)
        subtree_end = _subtree_ends(pieces, cursor)
        sample_index = [
            self._sample_rows(i, s, node_start, copy_for_child, first_copy) for i, s in enumerate(self.samples)
        ]
        return Layout(input_ids, position_ids, parent, subtree_end, sample_index)

    def _sample_rows(
        self,
        number: int,
        sample: PackSample,
        node_start: dict[int, int],
        copy_for_child: dict[int, int],
        first_copy: dict[int, int],
    ) -> np.ndarray:
        """Row index of each token of ``sample`` (walks its path again after all splits)."""
        ids = sample.token_ids
        n_ids = len(ids)
        out = np.empty(n_ids, dtype=np.int64)
        node, pos = self._root, 0
        if not self.share_prefixes:  # flat: the sample's own chain
            chain = self._root.children[-1 - number]
            out[:] = node_start[id(chain)] + np.arange(n_ids)
            return out
        while pos < n_ids:
            child = node.children[int(ids[pos])]
            n = len(child.tokens)
            k = min(n, n_ids - pos)
            out[pos : pos + k] = node_start[id(child)] + np.arange(k)
            if k == n and id(child) in first_copy:  # the last token is forwarded once per trained branch
                nxt = child.children.get(int(ids[pos + n])) if pos + n < n_ids else None
                out[pos + n - 1] = copy_for_child[id(nxt)] if nxt is not None else first_copy[id(child)]
            node, pos = child, pos + k
        return out


def _subtree_ends(pieces: list[tuple[int, int, int, int]], total: int) -> np.ndarray:
    """Per row index, the exclusive end of its subtree.

    All tokens of an emitted chain share it (their subtree is the rest of the chain plus
    the descendants of its last token); a chain's subtree ends where depth-first order
    comes back to a token no deeper than the chain's last token.
    """
    out = np.empty(total, dtype=np.int64)
    open_pieces: list[tuple[int, int, int]] = []  # (start, stop, last depth)
    for start, stop, first_depth, last_depth in pieces:
        while open_pieces and open_pieces[-1][2] >= first_depth:
            s, e, _ = open_pieces.pop()
            out[s:e] = start
        open_pieces.append((start, stop, last_depth))
    for s, e, _ in open_pieces:
        out[s:e] = total
    return out
