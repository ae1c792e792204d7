"""`AsyncGRPOConfig`: every knob of asynchronous GRPO, as a `transformers.TrainingArguments` dataclass.

Users expect a `TrainingArguments`-style config (CLI parsing with `HfArgumentParser`, `report_to`, checkpoints).
Cross-field rules (`config_checks.py`) are checked once in `__post_init__`, and every problem is reported in one
`ValueError` that says what to change. Works with transformers 5.17 and 5.24 (field sets differ; optional ones
are read with `getattr`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from asyncgrpo.config_checks import config_problems, parse_json_dict
from asyncgrpo.config_data import DATA_FIELDS, DataFields
from asyncgrpo.config_loss import LossFields, resolve_loss_fields
from asyncgrpo.config_moe import MoeReplayFields
from asyncgrpo.config_speed import SpeedFields
from asyncgrpo.config_trl import TRLFields

logger = logging.getLogger(__name__)

DEFAULT_SERVER_URL = "http://localhost:8000"  # vllm serve's default port
# TrainingArguments fields this trainer never reads, with what decides instead; set away from their default they
# get a warning (a TRL config moved over keeps working), and `asyncgrpo train --help` does not list them.
IGNORED_FIELDS = {
    "per_device_train_batch_size": "a step is filled with packed samples up to token_budget tokens per row, "
    "gradient_accumulation_steps rows per process (raise those instead)",
    "per_device_eval_batch_size": "held-out prompts are generated on the server, all at once",
    "auto_find_batch_size": "rows are bounded by token_budget",
    "dataloader_num_workers": "samples come from the rollout worker, not a DataLoader",
    "dataloader_drop_last": "samples come from the rollout worker, not a DataLoader",
    "eval_accumulation_steps": "evaluation runs on the server",
}
# transformers >= 5.2x renamed gradient_checkpointing -> activation_checkpointing (old name kept as an alias).
_HAS_ACTIVATION_CHECKPOINTING = any(f.name == "activation_checkpointing" for f in dataclasses.fields(TrainingArguments))


# `asyncgrpo train --help` lists the fields in these sections, in this order (tests/unit/test_cli_help.py checks
# that every AsyncGRPOConfig field is in exactly one); the first section also takes common TrainingArguments fields.
FIELD_SECTIONS: dict[str, tuple[str, ...]] = {
    "run length, optimizer, checkpoints": (
        "output_dir", "max_steps", "num_train_epochs", "learning_rate", "lr_scheduler_type", "warmup_steps",
        "gradient_accumulation_steps", "max_grad_norm", "weight_decay", "optim", "seed", "bf16",
        "gradient_checkpointing", "save_strategy", "save_steps", "save_total_limit", "logging_steps",
        "eval_strategy", "eval_steps", "report_to", "push_to_hub", "hub_model_id",
    ),
    "model": ("model_init_kwargs", "dtype", "trust_remote_code", "router_aux_loss_coef"),
    "mixture-of-experts routing replay": ("router_replay", "vllm_return_routed_experts"),
    "generation": (
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "chat_template_kwargs", "max_tool_calling_iterations",
    ),
    "generation server": (
        "vllm_server_base_url", "vllm_server_timeout", "vllm_server_connect_timeout", "vllm_server_restart_timeout",
    ),
    "loss and packing": (
        "loss_type", "importance_sampling_level", "scale_rewards", "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_cap", "epsilon", "epsilon_high", "score_centering", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max", "num_sampler_logprobs", "token_budget", "compile_decoder_layers", "activation_memory_budget", "tree_attention_backend", "warm_up_compile", "cuda_graph_step",
    ),
    "asynchronous pipeline": (
        "max_concurrent_rollouts", "answer_parse_processes", "max_staleness", "sync_rollouts", "weight_sync_steps",
        "weight_sync_topology", "weight_sync_backend", "rollout_worker_timeout",
    ),
    "TRL 1.16 names and timeouts": (
        "max_inflight_tasks", "queue_maxsize", "heartbeat_stale_after_s", "request_timeout", "weight_sync_timeout",
        "fork_threshold_tokens",
    ),
    "logging and evaluation": (
        "log_completions", "num_completions_to_print", "compact_log", "eval_temperature", "eval_num_generations",
    ),
    "data: dynamic sampling, prompt pools": DATA_FIELDS,
}  # fmt: skip
# Fields `--help` does not list: ignored (IGNORED_FIELDS), refused whatever their value, fixed by this trainer, or
# replaced by a command flag (--resume).
HIDDEN_FIELDS = frozenset({
    *IGNORED_FIELDS, "deepspeed", "use_liger_kernel", "liger_kernel_config", "ignore_data_skip",
    "remove_unused_columns", "resume_from_checkpoint",
})  # fmt: skip


def _bf16_device_available() -> bool:
    """True when an accelerator that trains in bf16 is visible (CPU-only machines train in fp32 by default)."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


@dataclass
class AsyncGRPOConfig(
    TRLFields, LossFields, DataFields, MoeReplayFields, SpeedFields, TrainingArguments
):  # mixins first: output_dir stays the first field
    """Configuration of `AsyncGRPOTrainer`.

    Only the parameters specific to asynchronous GRPO are listed here; see `transformers.TrainingArguments` for
    the rest. Defaults that differ from `TrainingArguments`: `logging_steps=1`, `gradient_checkpointing=True`,
    `bf16=True` unless `fp16` is set (or no bf16-capable accelerator is visible: CPU-only runs train in fp32),
    `learning_rate=1e-6`, `lr_scheduler_type="constant"` (the number of optimizer steps per epoch is not known in
    advance), `ignore_data_skip=True` (resume skips to the first untrained prompt instead of replaying batches) and
    `remove_unused_columns=False` (every dataset column reaches the reward functions).

    `num_train_epochs` counts passes over the prompt dataset by distinct prompts trained; `max_steps > 0` stops on
    optimizer steps instead.
    """

    # ---- changed TrainingArguments defaults -------------------------------------------------------------------
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer steps (or a ratio if < 1)."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Recompute activations in the backward pass to save memory. Defaults to True for this trainer.",
            "nargs": "?",
            "const": True,
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train in bf16 mixed precision. Defaults to True unless `fp16` is set or no bf16-capable "
            "accelerator is visible (CPU-only runs default to fp32)."
        },
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate of the AdamW optimizer."})
    lr_scheduler_type: str = field(
        default="constant",
        metadata={
            "help": "Learning-rate schedule. Defaults to constant: the number of optimizer steps per epoch depends on "
            "how conversations fork and is not known in advance. For a decaying schedule also set `max_steps`."
        },
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "Must stay True: on resume the rollout worker skips to the first untrained prompt "
            "(rollout_state.json) instead of replaying batches."
        },
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: every dataset column is passed to the reward functions."}
    )

    # ---- model -------------------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `from_pretrained` when the model is given as a path or hub id. Its "
            "`revision` is also used to load the processing class. Its `dtype` takes precedence over `dtype`."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype the weights are loaded in: 'auto', 'bfloat16', 'float16' or 'float32'. The train-inference "
            "mismatch the ratios measure depends on the trainer's precision; serve the model in the same dtype "
            "(a mismatch is warned about at start). Under FSDP mixed precision master weights stay fp32 whatever "
            "this is; dtype='bfloat16' with bf16=True is pure bf16 training."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models and tokenizers that ship custom Python code. Forwarded to `from_pretrained`."},
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the Mixture-of-Experts load-balancing auxiliary loss added to the training loss. None "
            "uses the model config's value; 0.0 disables it. Fails with a model that is not MoE."
        },
    )

    # ---- generation --------------------------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Number of rollouts sampled per prompt (group size)."})
    max_completion_length: int = field(
        default=2048,
        metadata={"help": "Maximum tokens generated per sampling request, i.e. per turn of a multi-turn rollout."},
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature; higher values give more random completions."}
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Cumulative probability of the top tokens considered, in (0, 1]; 1.0 considers all tokens. Below "
            "1.0 `top_k` must also be set, and the server must return sampling masks (vLLM >= 0.28 with "
            "--return-sampling-mask --enable-scale-out, or the embedded server); the trainer renormalises log-probs "
            "over each token's candidate set like the server does. Older servers keep the full vocabulary."
        },
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": "Number of highest-probability tokens kept for top-k filtering; 0 disables it. Other values need "
            "the server flags described under `top_p`."
        },
    )
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Minimum token probability, scaled by the probability of the most likely token; in [0, 1], "
            "typically 0.01-0.2. Above 0.0 `top_k` must also be set (see `top_p`)."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "Penalty on tokens already present in the prompt or completion; 1.0 disables it."},
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for `apply_chat_template` when rendering prompts."},
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Maximum tool-calling turns when training agents. None: no limit; generation stops when the model "
            "answers without a tool call."
        },
    )

    # ---- generation server -------------------------------------------------------------------------------------
    vllm_server_base_url: str | list[str] = field(
        default=DEFAULT_SERVER_URL,
        metadata={
            "help": "Base URL of the generation server (vLLM or `asyncgrpo serve`), or several (a list, or one "
            "comma-separated string): each GRPO group goes to the least loaded server, every weight sync reaches "
            "all of them, and a server that stops answering is dropped with a warning naming it (the run goes on "
            "with the rest; it stops when none is left)."
        },
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Timeout in seconds for server calls: waiting for the server at start, each generation request and "
            "each weight-sync call. Waits and weight syncs raise on timeout; generation requests are retried."
        },
    )
    vllm_server_connect_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Seconds train() waits at start for a server address that refuses connections (nothing listens "
            "there yet). A server that accepts connections but is still loading is waited for up to "
            "vllm_server_timeout. Raise it when the trainer starts before a server that takes long to open its port."
        },
    )
    vllm_server_restart_timeout: float = field(
        default=120.0,
        metadata={
            "help": "Seconds a run keeps retrying a generation server that stopped answering (e.g. restarted). If it "
            "comes back, the trainer forms the weight-transfer group again, pushes the current weights and continues; "
            "otherwise the run stops with 'server ... gone since ...'. 0 = stop at once."
        },
    )

    # ---- loss --------------------------------------------------------------------------------------------------
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon of the clipped surrogate."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping epsilon. Defaults to `epsilon`; the DAPO paper recommends 0.28."},
    )
    score_centering: bool = field(
        default=True,
        metadata={
            "help": "loss_type='asyncgrpo' only (off for the others). Train with score centering instead of the "
            "clipped surrogate: subtract from each sampled token's "
            "importance-weighted score its expectation under the sampler, so a constant advantage does not pull "
            "the policy toward the sampler. The expectation runs over the `num_sampler_logprobs` most likely tokens "
            "at each position, whose log-probs the sampler reports."
        },
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5,
        metadata={
            "help": "Lower bound C_min of the trainer/sampler importance ratio: the *_mask modes of "
            "vllm_importance_sampling_mode drop tokens (sequences) whose ratio lies outside [C_min, C_max] (the "
            "reference's masked importance sampling), the *_truncate modes clamp the ratio to it."
        },
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata={"help": "Upper bound C_max of the importance ratio (TRL's default is 3.0)."}
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata={
            "help": "Top log-probs requested from the sampler for each generated token, for score centering. Larger "
            "values cover more of the sampler's mass but cost serialisation; the server's --max-logprobs caps it."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Maximum tokens forwarded in one row (one process's forward). Rows are filled up to it with "
            "attention-cost balancing, bounding peak memory whatever the number of samples. Shared prefix tokens "
            "count once. A group goes into one row whole when it fits there (its prompt forwarded once); a group "
            "larger than the budget, or one that would be too stale by the next step, is placed sample by sample. "
            "None: the server's max_model_len, read at start. Longer samples are dropped with a warning."
        },
    )

    # ---- asynchronous pipeline ---------------------------------------------------------------------------------
    max_concurrent_rollouts: int = field(
        default=512,
        metadata={
            "help": "Maximum rollouts running at once. Each holds an environment, may run sync tool calls in a thread "
            "pool of this size and keeps a server connection: set it to what those resources can take. Below it, the "
            "server's KV-cache usage and `max_staleness` decide how many run."
        },
    )
    answer_parse_processes: int | None = field(
        default=None,
        metadata={
            "help": "Helper processes of the rollout worker that parse large generation answers (32 KB and more) off "
            "its event loop. None: a quarter of the CPUs this process may use, at most 4 (none on 2 CPUs); 0 parses "
            "every answer on the event loop."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "How many weight updates a sample may lag behind the current policy; older samples are dropped. "
            "Generation is paced by it: a new group starts only while the tokens queued or in flight fit in what the "
            "trainer consumes in max(max_staleness, 1) steps."
        },
    )
    sync_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Synchronous baseline: the worker starts groups only while the trainer is waiting for samples, so "
            "generation and training never overlap (as in a synchronous GRPO trainer). For comparisons and debugging; "
            "slower by design. Groups still in flight when a step starts training land one update behind: keep "
            "max_staleness >= 1 to train them rather than drop them."
        },
    )
    weight_sync_steps: int = field(
        default=1, metadata={"help": "Push the policy weights to the server every this many optimizer steps."}
    )
    weight_sync_topology: str = field(
        default="per_server",
        metadata={
            "help": "With several generation servers: 'per_server' gives each server its own NCCL group with the "
            "trainer (each tensor sent once per server), 'shared' one group of the trainer and every server worker "
            "(each tensor sent once; every rank needs its own GPU). One server: unused."
        },
    )
    weight_sync_backend: str = field(
        default="auto",
        metadata={
            "help": "How weights reach the server: 'auto' (CUDA IPC when the server reports the trainer's own GPU, "
            "NCCL when another GPU, gloo on CPU; a real vLLM's own --weight-transfer-config backend otherwise), "
            "'ipc', 'nccl' or 'gloo'. An explicit choice the server cannot take stops the run at start."
        },
    )
    rollout_worker_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds since the rollout worker's last heartbeat after which the trainer stops the run."},
    )

    # ---- logging -----------------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False, metadata={"help": "Log a sample of (prompt, completion) pairs every `logging_steps` steps."}
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Number of completions printed with rich. None: all logged completions."}
    )
    compact_log: bool = field(
        default=False,
        metadata={
            "help": "Print one short line per logging window (reward, kept reward, dropped groups, completion length, "
            "step, wait and sync seconds) and the run doctor's verdicts every 10 windows, instead of transformers' "
            "whole metrics dict (what `asyncgrpo train` prints). <output_dir>/metrics.jsonl and report_to still get "
            "every metric."
        },
    )

    # ---- evaluation (eval_dataset, eval_strategy and eval_steps are TrainingArguments') ----------------------------
    eval_temperature: float = field(default=0.0, metadata={"help": "Held-out sampling temperature; 0.0 is greedy."})
    eval_num_generations: int = field(default=1, metadata={"help": "Completions per held-out prompt (eval/* means)."})

    def __post_init__(self) -> None:
        self.model_init_kwargs = parse_json_dict(self.model_init_kwargs, "model_init_kwargs")
        self.chat_template_kwargs = parse_json_dict(self.chat_template_kwargs, "chat_template_kwargs")
        resolve_loss_fields(self)  # loss_type's defaults (config_loss.py) before epsilon_high falls back
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.vllm_server_base_url is None:  # HfArgumentParser gives None for an omitted list-typed flag
            self.vllm_server_base_url = DEFAULT_SERVER_URL
        self._resolve_changed_defaults()
        self._warn_ignored()
        problems = config_problems(self)
        if problems:
            listing = "\n".join(f"  - {p}" for p in problems)
            raise ValueError(f"AsyncGRPOConfig has {len(problems)} problem(s):\n{listing}")
        super().__post_init__()

    def _warn_ignored(self) -> None:
        """One warning naming each field of ``IGNORED_FIELDS`` that was set, and what decides instead."""
        defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
        for name, instead in IGNORED_FIELDS.items():
            if name in defaults and getattr(self, name, defaults[name]) != defaults[name]:
                logger.warning("%s=%r is ignored by AsyncGRPOTrainer: %s", name, getattr(self, name), instead)

    def _resolve_changed_defaults(self) -> None:
        """Fill the defaults that depend on other fields or on the machine."""
        if _HAS_ACTIVATION_CHECKPOINTING:
            # The document names this knob gradient_checkpointing: accept it without transformers' rename warning.
            if getattr(self, "activation_checkpointing", None) is None:
                gc = self.gradient_checkpointing
                self.activation_checkpointing = True if gc is None else gc
        elif self.gradient_checkpointing is None:
            self.gradient_checkpointing = True
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _bf16_device_available()
            if not self.bf16 and not self.fp16:
                logger.info("No bf16-capable accelerator visible: training in fp32 (pass bf16=True to override).")

    @property
    def server_urls(self) -> tuple[str, ...]:
        """``vllm_server_base_url`` as a tuple of URLs (a list, or a comma-separated string, split)."""
        value = self.vllm_server_base_url
        items = [value] if isinstance(value, str) else list(value)  # the CLI parser gives a list either way
        return tuple(u.strip().rstrip("/") for item in items for u in str(item).split(",") if u.strip())
