"""``asyncgrpo train --help`` and ``eval --help`` that a user can read (issue 30, item 8).

``HfArgumentParser`` turns all ~150 fields of ``TrainingArguments`` into flags, in declaration order, so the
command's own ``--config`` came at line 138 of 840. This module rearranges the help only (parsing is
unchanged): a short usage line, the command's own options first, then ``AsyncGRPOConfig``'s fields in the
sections of ``config.FIELD_SECTIONS``, then the remaining ``TrainingArguments`` fields (first sentence of their
help); ``eval`` shows only the fields that change a score (issue 44 item 7); the fields the trainer
ignores or refuses (``config.HIDDEN_FIELDS``) are left out of the help but still parse (and are refused or warned
about by the config's checks).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

OTHER_TITLE = "other transformers.TrainingArguments fields"
MAX_INVOCATION = 80  # a flag line longer than this names its value VALUE
MAX_INLINE_CHOICES = 40  # a choice list longer than this (characters) goes into the wrapped help, not the flag line
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

    def _format_action_invocation(self, action: argparse.Action) -> str:
        """``--max_steps, --max-steps MAX_STEPS``: the value named once (argparse before 3.13 repeats it after
        each spelling, 144 characters for ``--vllm_server_base_url``; the invocation is never wrapped)."""
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        flags = ", ".join(action.option_strings)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        if len(flags) + len(value) > MAX_INVOCATION and action.metavar is None and not action.choices:
            value = self._format_args(action, "VALUE")  # the field's name is already written twice
        return flags + " " + value


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


def _choices_into_help(action: argparse.Action) -> None:
    """A long choice list (``--optim``: 40 optimizers, a 644-character flag line) moves into the help text, which
    argparse wraps; the flag shows the field's name instead."""
    if not action.choices or action.help is argparse.SUPPRESS:
        return
    names = [str(c) for c in action.choices]
    if len(",".join(names)) > MAX_INLINE_CHOICES:
        action.metavar = action.dest.upper()
        action.help = f"{(action.help or '').rstrip()} One of: {', '.join(names)}.".lstrip()


def organize_help(
    parser: argparse.ArgumentParser,
    own: argparse._ArgumentGroup,
    usage: str,
    sections: Mapping[str, tuple[str, ...]] | None = None,
    rest_note: str | None = None,
) -> None:
    """Regroup ``parser``'s help: ``own`` first, then the config sections, then the rest; hide ``HIDDEN_FIELDS``.

    ``sections`` (title: field names): the sections to show, default every ``AsyncGRPOConfig`` section followed by
    the other ``TrainingArguments`` fields. A command that reads few fields (``eval``) passes its own; the fields
    it leaves out still parse, and ``rest_note`` says so in place of their list.

    Uses argparse's group lists (``_action_groups``, ``_group_actions``): help layout only, parsing untouched.
    """
    from asyncgrpo.config import FIELD_SECTIONS, HIDDEN_FIELDS

    parser.usage = usage
    parser.formatter_class = DefaultsFormatter
    by_dest = _dest_actions(parser)
    for name, text in HELP_OVERRIDES.items():
        for action in by_dest.get(name, []):
            action.help = text
    if sections is None:
        sections = {f"AsyncGRPOConfig: {title}": names for title, names in FIELD_SECTIONS.items()}
    own_dests = {a.dest for a in own._group_actions}
    placed: set[str] = set(own_dests) | {"help"}
    for group in parser._action_groups:
        if group is not own:  # empty every other group; the fields are re-added below in our order
            group._group_actions = [a for a in group._group_actions if a.dest == "help"]
    groups = []
    for title, names in sections.items():
        group = parser.add_argument_group(title)
        for name in names:
            for action in by_dest.get(name, []):
                group._group_actions.append(action)
            placed.add(name)
        groups.append(group)
    if rest_note is None:
        rest = parser.add_argument_group(OTHER_TITLE, "accepted as in transformers; most runs never need them")
    else:
        rest = parser.add_argument_group("other fields", rest_note)
    for dest, actions in by_dest.items():
        if dest in placed:
            continue
        for action in actions:
            if dest in HIDDEN_FIELDS or rest_note is not None:
                action.help = argparse.SUPPRESS
            else:
                action.help = _first_sentence(action.help)
                rest._group_actions.append(action)
    for action in parser._actions:
        _choices_into_help(action)
    # order: options (-h), the command's own group, the sections, the rest
    first = [g for g in parser._action_groups if g._group_actions and g not in (own, rest, *groups)]
    parser._action_groups[:] = [*first, own, *groups, rest]
