"""``asyncgrpo train --help`` and ``eval --help`` that a user can read (issue 30, item 8).

``HfArgumentParser`` turns all ~150 fields of ``TrainingArguments`` into flags, in declaration order, so the
command's own ``--config`` came at line 138 of 840. This module rearranges the help only (parsing is
unchanged): a short usage line, the command's own options first, then ``AsyncGRPOConfig``'s fields in the
sections of ``config.FIELD_SECTIONS``, then the remaining ``TrainingArguments`` fields (first sentence of their
help); the fields the trainer
ignores or refuses (``config.HIDDEN_FIELDS``) are left out of the help but still parse (and are refused or warned
about by the config's checks).
"""

from __future__ import annotations

import argparse

OTHER_TITLE = "other transformers.TrainingArguments fields"
# transformers' help texts that describe a DataLoader batch this trainer does not have
HELP_OVERRIDES = {
    "gradient_accumulation_steps": "Packed rows per process trained before each optimizer step (micro-batches of "
    "token_budget tokens each).",
}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not state its default already and X says something."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _first_sentence(text: str | None) -> str | None:
    """The first sentence of a help text (the rest of transformers' long helps is in its documentation)."""
    if not text or text is argparse.SUPPRESS:
        return text
    head, dot, _ = text.partition(". ")
    return head + ("." if dot else "")


def _dest_actions(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """Actions by destination (a boolean field has two flags: ``--x`` and ``--no_x``)."""
    out: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        out.setdefault(action.dest, []).append(action)
    return out


def organize_help(parser: argparse.ArgumentParser, own: argparse._ArgumentGroup, usage: str) -> None:
    """Regroup ``parser``'s help: ``own`` first, then the config sections, then the rest; hide ``HIDDEN_FIELDS``.

    Uses argparse's group lists (``_action_groups``, ``_group_actions``): help layout only, parsing untouched.
    """
    from asyncgrpo.config import FIELD_SECTIONS, HIDDEN_FIELDS

    parser.usage = usage
    parser.formatter_class = DefaultsFormatter
    by_dest = _dest_actions(parser)
    for name, text in HELP_OVERRIDES.items():
        for action in by_dest.get(name, []):
            action.help = text
    own_dests = {a.dest for a in own._group_actions}
    placed: set[str] = set(own_dests) | {"help"}
    for group in parser._action_groups:
        if group is not own:  # empty every other group; the fields are re-added below in our order
            group._group_actions = [a for a in group._group_actions if a.dest == "help"]
    sections = []
    for title, names in FIELD_SECTIONS.items():
        group = parser.add_argument_group(f"AsyncGRPOConfig: {title}")
        for name in names:
            for action in by_dest.get(name, []):
                group._group_actions.append(action)
            placed.add(name)
        sections.append(group)
    rest = parser.add_argument_group(OTHER_TITLE, "accepted as in transformers; most runs never need them")
    for dest, actions in by_dest.items():
        if dest in placed:
            continue
        for action in actions:
            if dest in HIDDEN_FIELDS:
                action.help = argparse.SUPPRESS
            else:
                action.help = _first_sentence(action.help)
                rest._group_actions.append(action)
    # order: options (-h), the command's own group, the sections, the rest
    first = [g for g in parser._action_groups if g._group_actions and g not in (own, rest, *sections)]
    parser._action_groups[:] = [*first, own, *sections, rest]
