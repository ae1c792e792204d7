"""``RolloutSettings``: everything the rollout worker knows about the run, as plain values.

The trainer builds one record in the parent process (``AsyncGRPOTrainer.rollout_settings``)
once the server has been probed, and hands it to the rollout loop; the loop never sees
the ``TrainingArguments``. Each on/off decision of the run is taken once, by the
trainer, and arrives here as a value: score centering is on exactly when
``num_sampler_logprobs`` is not None.

A custom loop that needs its own knobs reads them from ``extra``, which the trainer
subclass fills by overriding ``rollout_settings`` (see ``AsyncRolloutLoop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.client.transport import DEFAULT_TIMEOUT_S
from asyncgrpo.rollout.prompt_pools import PoolSettings
from asyncgrpo.rollout.sampling import SamplingSettings


@dataclass(frozen=True)
class RolloutSettings:
    """The worker's view of the run (frozen, picklable: it crosses the spawn).

    Args:
        model_name: the name the server serves the policy under (a LoRA adapter name selects an adapter).
        sampling: per-request values resolved against the server (URL, limits, sampling parameters, top-N).
        num_generations: rollouts per prompt (G).
        max_staleness: the config's ``max_staleness``; paces generation in tokens (G3).
        seed: the run's seed; every request gets a distinct seed derived from it (G7).
        max_concurrent_rollouts: hard bound on rollouts in flight, connections and reward threads (G5, G6).
        initial_tokens_per_step: G3's assumption before the first step, ``token_budget × rows per step``.
        request_timeout_s: one generation request's HTTP timeout (the config's ``request_timeout``).
        queue_maxsize: most samples waiting in the sample queue (the config's ``queue_maxsize``; 0: no bound).
        fork_threshold_tokens: realign drifts inside the last answer shorter than this (``reconcile.py``; 0: fork).
        eos_token_ids: token ids that end a completion.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` when rendering prompts.
        max_tool_calling_iterations: executed tool-calling turns per rollout (None: until a turn has no call).
        log_completions: send prompt and completion texts with each group, for the trainer's completion log.
        dataset_start_index: the first untrained prompt (resume, T5), counted over epochs.
        num_epochs: passes over the dataset to generate (None: until the trainer stops the worker).
        skip_indices: flat prompt indices past ``dataset_start_index`` a checkpoint settled: not generated (X3).
        retry_for_s: how long a request to a server that stopped answering is retried (the config's
            ``vllm_server_restart_timeout``).
        lora_name: adapter sync (T6): requests name the LoRA adapter ``<lora_name>-step-<version>`` of the policy
            version their rollout started under instead of ``model_name`` (None: merged weights, ``model_name``).
        lora_dir: adapter sync: the directory holding each adapter version (``<output_dir>/.vllm_lora``), from which
            a rollout registers its adapter again on a server that lost it (it restarted).
        sync_rollouts: start groups only while the trainer waits for samples (the config's ``sync_rollouts``).
        answer_parse_processes: helper processes that parse large answers off the worker's event loop
            (``client/answer_parse.py``); None: a quarter of the machine's cores, at most 4; 0: inline.
        scale_rewards: divide advantages by the group's reward std (the config's ``scale_rewards`` 'group'); False
            for 'none' (Dr. GRPO).
        extra: free-form values for custom loops; the library never reads it.
        prompt_pools: the difficulty pools' settings when ``prompt_pools`` is on (``rollout/prompt_pools.py``).
        pool_state: the pools' state a checkpoint recorded (resume), or None.
        pass_threshold: a sample passes (the pools' pass rates) when its total reward is at least this.
        evaluation: the settings of a held-out evaluation (``tasks/agent_eval.py``): its groups are scored, never
            trained, so a group may hold a single rollout; the staleness fields are unused (no admission).
    """

    model_name: str
    sampling: SamplingSettings
    num_generations: int
    max_staleness: int
    seed: int
    max_concurrent_rollouts: int
    initial_tokens_per_step: int
    request_timeout_s: float = DEFAULT_TIMEOUT_S
    queue_maxsize: int = 0
    fork_threshold_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tool_calling_iterations: int | None = None
    log_completions: bool = False
    dataset_start_index: int = 0
    num_epochs: int | None = None
    skip_indices: frozenset[int] = frozenset()
    retry_for_s: float = 0.0
    sync_rollouts: bool = False
    answer_parse_processes: int | None = None
    scale_rewards: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None
    lora_dir: str | None = None
    prompt_pools: PoolSettings | None = None
    pool_state: dict[str, Any] | None = None
    pass_threshold: float = 1.0
    evaluation: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.num_generations < (1 if self.evaluation else 2):
            need = ">= 1 sample per prompt" if self.evaluation else "GRPO needs >= 2 rollouts per prompt"
            problems.append(f"num_generations={self.num_generations}: {need}")
        if self.max_concurrent_rollouts < 1:
            problems.append(f"max_concurrent_rollouts={self.max_concurrent_rollouts}: must be >= 1")
        if self.initial_tokens_per_step < 1:
            problems.append(f"initial_tokens_per_step={self.initial_tokens_per_step}: must be >= 1")
        if self.max_staleness < 0:
            problems.append(f"max_staleness={self.max_staleness}: must be >= 0")
        if self.request_timeout_s <= 0:
            problems.append(f"request_timeout_s={self.request_timeout_s}: must be > 0")
        if self.dataset_start_index < 0:
            problems.append(f"dataset_start_index={self.dataset_start_index}: must be >= 0")
        if problems:
            raise ValueError("invalid RolloutSettings: " + "; ".join(problems))

    def request_model(self, policy_version: int) -> str:
        """The ``model`` field of a request generated under ``policy_version``."""
        return self.model_name if self.lora_name is None else lora_adapter_name(self.lora_name, policy_version)

    @property
    def num_sampler_logprobs(self) -> int | None:
        """Sampler top-N log-probs kept per trained token; None when score centering is off."""
        return self.sampling.num_sampler_logprobs


def lora_adapter_name(prefix: str, policy_version: int) -> str:
    """The adapter name of a policy version under adapter sync; the trainer registers it under this name."""
    return f"{prefix}-step-{policy_version}"


class ConfigView:
    """Read-only attribute access to the fields an ``AsyncGRPOConfig`` subclass adds (``settings.extra``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(
            f"the rollout loop's config has no field {name!r}: it holds only the fields your AsyncGRPOConfig "
            f"subclass adds ({sorted(values)}); read the run's own settings from self.settings "
            "(e.g. self.settings.num_generations, self.settings.sampling.temperature)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the rollout loop's config is read-only")
