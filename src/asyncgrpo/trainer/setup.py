"""The run's wiring at ``train()`` start: read the servers, then build the worker, the sample source and the weight sync.

The one place that joins the packages (as a torchtune recipe does): the trainer gets a :class:`RunParts` and never
imports the client, the rollout worker's internals or a weight-sync implementation; ``weights/`` never imports the
client (it is handed clients that satisfy ``weights/base.ServerControl``). Every mode decision of the weight sync is
taken here: adapter sync (T6) when the model is a PEFT model and every server runs with ``--enable-lora``, else
merged weights to one server (restart recovery) or to several (dead servers dropped, X5).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.config_trl import describe_aliases
from asyncgrpo.packing import TokenBudgetBatcher
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.rewards import check_picklable
from asyncgrpo.rollout.sampling import truncates_distribution
from asyncgrpo.rollout.settings import RolloutSettings, lora_adapter_name
from asyncgrpo.rollout.worker import RolloutWorker
from asyncgrpo.trainer.checkpoint import ResumePoint
from asyncgrpo.trainer.data_accounting import DataAccounting
from asyncgrpo.trainer.moe_replay import check_server_routing
from asyncgrpo.trainer.packed_forward import causal_lm_of
from asyncgrpo.trainer.rollout_source import RolloutSource
from asyncgrpo.trainer.served_weights import warn_on_foreign_weights
from asyncgrpo.trainer.server_setup import (
    ServerFacts,
    check_completion_length,
    check_dtype,
    check_sampling_limits,
    check_weight_transfer,
    probe_servers,
)
from asyncgrpo.trainer.trl_weights import NamedTimeouts, TRLWeightTransferSync, check_weight_transfer_protocol
from asyncgrpo.trainer.trl_worker import TRLWorkerHost, check_rollout_worker_protocol
from asyncgrpo.weights.base import WeightSync
from asyncgrpo.weights.collectives import DEFAULT_PACKED_BUFFER_SIZE_BYTES
from asyncgrpo.weights.lora_sync import AdapterFollower, AdapterSyncSettings, lora_cache_dir, start_adapter_sync
from asyncgrpo.weights.policy import GatherFollower, is_peft_model
from asyncgrpo.weights.sender import WeightSender

logger = logging.getLogger(__name__)


class SetupSeam(Protocol):
    """What the wiring reads of ``AsyncGRPOTrainer`` (declared here so this file never imports the trainer)."""

    args: Any
    model: Any
    model_id: str
    train_dataset: Any
    reward_funcs: list[Any]
    processing_class: Any
    tools: list[Any]
    environment_factory: Any
    loop_cls: type[AsyncRolloutLoop]
    lora_prefix: str
    rollout_worker: Any  # TRL 1.16's RolloutWorkerProtocol object, or None for ours
    weight_transfer: Any  # TRL 1.16's WeightTransferProtocol object, or None for ours

    def is_world_process_zero(self) -> bool: ...

    def share_from_rank_zero(self, obj: Any) -> Any: ...

    def rollout_settings(self, facts: ServerFacts, start_index: int) -> RolloutSettings: ...


@dataclass
class RunParts:
    """What ``train()`` runs with: built once at its start, stopped at its end (``worker``/``source``: rank 0)."""

    weight_sync: WeightSync
    worker: RolloutWorker | TRLWorkerHost | None = None
    source: RolloutSource | None = None


def check_plugins(rollout_worker: Any, weight_transfer: Any) -> None:
    """``AsyncGRPOTrainer(rollout_worker=, weight_transfer=)``: a ``TypeError`` naming the first missing method."""
    if rollout_worker is not None:
        check_rollout_worker_protocol(rollout_worker)
    if weight_transfer is not None:
        check_weight_transfer_protocol(weight_transfer)


def adapter_sync_chosen(facts: ServerFacts, model: torch.nn.Module) -> bool:
    """T6: a PEFT model and servers that take adapters get adapters instead of merged weights."""
    return facts.lora_enabled and is_peft_model(model)


def read_servers(trainer: SetupSeam) -> ServerFacts | None:
    """Rank 0 probes every server and checks the run against its limits; every process gets the facts.

    None when a TRL rollout worker and weight transfer replace ours: nothing of ours talks to a server then.
    """
    args: AsyncGRPOConfig = trainer.args
    line = describe_aliases(args)
    if line and trainer.is_world_process_zero():
        logger.warning("%s", line)  # the run's start line about TRL 1.16 names: seen in scripts too (issue 43)
    if trainer.rollout_worker is not None and trainer.weight_transfer is not None:
        if args.token_budget is None:
            raise ValueError("token_budget=None reads the server's max_model_len, but rollout_worker and "
                             "weight_transfer replace everything that talks to the server: set token_budget")  # fmt: skip
        return None
    facts = None
    if trainer.is_world_process_zero():
        want_masks = truncates_distribution(args.top_k, args.top_p, args.min_p)
        facts = probe_servers(args.server_urls, args.vllm_server_timeout, want_masks,
                              connect_timeout=args.vllm_server_connect_timeout)  # fmt: skip
        check_completion_length(args.max_completion_length, facts.max_model_len, ", ".join(args.server_urls))
        check_dtype(causal_lm_of(trainer.model).dtype, facts.dtype)
        warn_on_foreign_weights(args.server_urls, trainer.model_id)  # on_train_begin pushes this run's weights
        n_logprobs = args.num_sampler_logprobs if args.score_centering else 0
        check_sampling_limits(facts, temperature=args.temperature, top_k=args.top_k, num_sampler_logprobs=n_logprobs)
        check_server_routing(args.wants_routed_experts, facts.routed_experts, args.server_urls)
    facts = trainer.share_from_rank_zero(facts)
    check_weight_transfer(facts, args.server_urls, adapter_sync_chosen(facts, trainer.model))
    return facts


def build_parts(trainer: SetupSeam, facts: ServerFacts | None, resume: ResumePoint, token_budget: int) -> RunParts:
    """The worker and source (rank 0, not started) and the weight sync of every process.

    A TRL 1.16 ``rollout_worker`` / ``weight_transfer`` given to the trainer replaces ours (``trl_worker.py``,
    ``trl_weights.py``); ``facts`` is None only when both are given.
    """
    args: AsyncGRPOConfig = trainer.args
    adapter = trainer.weight_transfer is None and facts is not None and adapter_sync_chosen(facts, trainer.model)
    if not trainer.is_world_process_zero():
        return RunParts(AdapterFollower() if adapter else GatherFollower())
    publisher = _start_adapter_sync(trainer, facts) if adapter else None  # checks the server's LoRA limits first
    dataset = trainer.train_dataset
    worker: RolloutWorker | TRLWorkerHost
    if trainer.rollout_worker is not None:
        first_row = max([resume.start_index, *(int(r) + 1 for r in (resume.settled or {}))])
        worker = TRLWorkerHost(trainer.rollout_worker, args.rollout_worker_timeout, first_row)
    else:
        assert facts is not None
        settings = trainer.rollout_settings(facts, resume.start_index)
        if adapter:
            settings = dataclasses.replace(
                settings, lora_name=trainer.lora_prefix, lora_dir=lora_cache_dir(args.output_dir)
            )
        settings = dataclasses.replace(settings, skip_indices=resume.skip, pool_state=resume.pools)
        loop = trainer.loop_cls(settings, dataset, trainer.reward_funcs, trainer.processing_class,
                                tools=trainer.tools, environment_factory=trainer.environment_factory)  # fmt: skip
        check_picklable(loop, f"rollout loop {type(loop).__name__}")
        ahead, trainer.worker_ahead = getattr(trainer, "worker_ahead", None), None
        worker = ahead.adopt(loop) if ahead is not None else RolloutWorker(loop, args.rollout_worker_timeout)
    n = len(dataset) if hasattr(dataset, "__len__") else None
    total = math.ceil(args.num_train_epochs * n) if (args.max_steps <= 0 and n) else None
    source = RolloutSource(
        worker,
        TokenBudgetBatcher(token_budget, args.world_size, keep_groups=True),  # a group in one row (B1)
        args.gradient_accumulation_steps,
        args.max_staleness,
        n or 0,
        start_index=resume.start_index,
        total_prompts=total,
        sample_timeout=args.vllm_server_timeout,
        weight_sync_steps=args.weight_sync_steps,
        settled=resume.settled,
        server_urls=args.server_urls,  # a step without trainable groups names a dead server as the cause
        data=DataAccounting.build(args, n, resume),
    )
    barrier = torch.distributed.barrier if args.world_size > 1 else None
    if trainer.weight_transfer is not None:
        sync: WeightSync = TRLWeightTransferSync(trainer.weight_transfer, args.weight_sync_timeout, barrier)
    elif publisher is not None:
        sync = publisher
    else:
        assert facts is not None
        sync = NamedTimeouts(_start_sender(args, facts, worker), args.weight_sync_timeout)
    return RunParts(sync, worker, source)


def spawn_worker_ahead(trainer: Any) -> None:
    """Spawn our rollout worker's process now (rank 0), to be handed its loop by ``build_parts``: a child imports
    torch, transformers and the user's script (4-5 s on an H200 machine) before it can generate, and spawned at
    ``train()``'s start that was all inside step 1."""
    if trainer.is_world_process_zero() and trainer.rollout_worker is None and trainer.worker_ahead is None:
        trainer.worker_ahead = RolloutWorker(None, heartbeat_timeout=trainer.args.rollout_worker_timeout)
        trainer.worker_ahead.spawn()


def _start_adapter_sync(trainer: SetupSeam, facts: ServerFacts) -> WeightSync:
    args: AsyncGRPOConfig = trainer.args
    sync = AdapterSyncSettings(tuple(args.server_urls), args.output_dir, args.max_staleness, trainer.lora_prefix,
                               args.vllm_server_timeout, args.vllm_server_restart_timeout)  # fmt: skip
    connect = functools.partial(AsyncServerClient, timeout=args.vllm_server_timeout, retries=0)
    assert facts.max_lora_rank is not None and facts.max_loras is not None
    limits = (facts.max_lora_rank, facts.max_loras, facts.lora_adapters)
    return start_adapter_sync(trainer.model, sync, limits, args.save_strategy, connect, lora_adapter_name)


def _start_sender(args: AsyncGRPOConfig, facts: ServerFacts, worker: RolloutWorker | TRLWorkerHost) -> WeightSender:
    """One server: it survives a restart of its server. Several: one group per server (or one shared); a server
    that stops answering is dropped and the worker told to stop routing there (X5)."""
    urls = args.server_urls
    backend = args.weight_sync_backend  # auto: ipc / nccl / gloo from the server's /server_info (weights/ipc.py)
    if len(urls) == 1:
        sender = WeightSender(timeout_s=args.weight_sync_timeout, restart_timeout_s=args.vllm_server_restart_timeout)
        sender.init(AsyncServerClient(urls[0]), facts.world_size, backend=backend, device=args.device)
    else:
        if backend == "auto":
            backend = facts.weight_backend or "auto"
        sender = WeightSender(timeout_s=args.weight_sync_timeout, topology=args.weight_sync_topology,
                              packed_buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES,  # as before the one sender
                              on_drop=worker.drop_server)  # fmt: skip
        sender.init([AsyncServerClient(u) for u in urls], facts.world_sizes, backend=backend, device=args.device)
    if args.world_size > 1:  # the other ranks wait here once the servers are paused (``GatherFollower``)
        sender.barrier = torch.distributed.barrier
    return sender
