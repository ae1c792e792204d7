"""``asyncgrpo eval --model DIR --config run.yaml``: a saved model scored on the YAML's ``eval_dataset``.

    asyncgrpo eval --model outputs/demo --config examples/demo.yaml [--eval_temperature 0] [--eval_num_generations 1]

The YAML's ``server`` section decides where generation runs (``embedded: true`` starts a server on DIR), its
reward functions score, and ``AsyncGRPOConfig`` flags override the file as with ``asyncgrpo train``.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.tasks.evaluate import evaluate_sync, settings_from_config

# The AsyncGRPOConfig fields `asyncgrpo eval` reads (settings_from_config, the tokenizer, the server address): its
# --help lists these; every other field still parses (a training YAML is accepted as is) and changes nothing here.
EVAL_HELP_SECTIONS: dict[str, tuple[str, ...]] = {
    "what is scored": (
        "eval_temperature", "eval_num_generations", "max_completion_length", "top_k", "chat_template_kwargs", "seed",
    ),
    "generation server": ("vllm_server_base_url", "vllm_server_timeout", "max_concurrent_rollouts"),
    "model": ("trust_remote_code",),
}  # fmt: skip
EVAL_REST_NOTE = (
    "every other AsyncGRPOConfig field of `asyncgrpo train --help` is accepted (a training YAML works as is) and "
    "does not change the score"
)


def run_eval(argv: list[str]) -> int:
    """``asyncgrpo eval --model DIR --config run.yaml``: the YAML's eval_dataset scored on ``DIR``'s weights."""
    import contextlib

    from transformers import AutoTokenizer

    from asyncgrpo.cli.launch import build_dataset, parse_train, resolve_model, start_embedded, wait_for_server
    from asyncgrpo.errors import UserError

    description = (
        "Score a model on the YAML's eval_dataset with its reward functions; AsyncGRPOConfig flags "
        "(--eval_temperature, --eval_num_generations, --max_completion_length) override the file."
    )

    def add_model(parser: Any) -> None:
        parser.add_argument("--model", required=True, help="the checkpoint directory (or hub id) to score")

    spec, ns = parse_train(argv, "asyncgrpo eval", description, add_model, (EVAL_HELP_SECTIONS, EVAL_REST_NOTE))
    if spec.eval_dataset is None:
        raise UserError(f"{ns.config} has no eval_dataset: add one (same keys as dataset, e.g. another seed)")
    model = resolve_model(ns.model)
    dataset = build_dataset(spec.eval_dataset)
    with contextlib.ExitStack() as stack:
        if spec.server.get("embedded"):
            base_url = start_embedded(stack, model, spec.server)
        else:
            base_url = spec.args.server_urls[0]  # evaluation uses the first server
            wait_for_server(base_url, float(spec.server.get("wait_s", 60)))
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=spec.args.trust_remote_code)
        s = settings_from_config(spec.args, base_url)
        scores = evaluate_sync(tokenizer, dataset, list(spec.reward_funcs), s)
    mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature}, {s.num_samples} per prompt"
    lines = [f"eval/reward {scores['eval/reward']:.4f} over {len(dataset)} prompts ({mode}) of {ns.model}"]
    lines += [f"  {k} {v:.4g}" for k, v in scores.items() if k not in ("eval/reward", "eval/num_prompts")]
    print("\n".join(lines), flush=True)
    return 0
