"""``AsyncGRPOTrainer``: a ``transformers.Trainer`` whose data source is the rollout queue (T1).

The Trainer machinery — optimizer and scheduler, gradient accumulation and clipping, callbacks, ``report_to``,
checkpoints, ``push_to_hub``, accelerate/FSDP — is transformers'. What changes:

* ``get_batch_samples`` pulls one optimizer step of packed micro-batches from the rollout worker
  (``RolloutSource``) instead of reading a DataLoader;
* ``training_step`` runs the packed forward through the prepared model (FSDP2, DDP or plain:
  ``trainer/packed_forward.py``), the chunked log-probs and the policy loss of ``trainer/loss.py``; under several
  processes rank 0 plans each step and scatters each process its own rows (``trainer/ranks.py``);
* a callback calls ``sync_weights`` every ``weight_sync_steps`` (push the weights to the server, hand the new
  version to the worker) and logs the step's ``StepStats``;
* the rollout worker gets one frozen ``RolloutSettings`` (``rollout_settings``), never the config.

    trainer = AsyncGRPOTrainer(model="path/or/id", reward_funcs=[accuracy_reward],
                               args=AsyncGRPOConfig(output_dir="out"), train_dataset=ds)
    trainer.train()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, Trainer

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.files import local_only, make_readable
from asyncgrpo.metrics import MetricsWindow, flops_per_token, peak_flops
from asyncgrpo.models import vlm
from asyncgrpo.packing import batch_metrics, build_plan, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.agents import prepare_tool_template
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.rewards import check_picklable, check_reward_signature, dataset_columns, reward_function_name
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.rollout.worker import GUARD_HINT, RolloutWorker
from asyncgrpo.tasks.eval_sets import EvalSet, as_eval_sets
from asyncgrpo.trainer.callbacks import AsyncGRPOCallback, MetricsFileCallback
from asyncgrpo.trainer.checkpoint import ResumePoint, prepare_resume, resolve_checkpoint
from asyncgrpo.trainer.compile import compile_for_training, start_compile_workers
from asyncgrpo.trainer.gpu_share import shared_gpu_oom
from asyncgrpo.trainer.graphed_step import GraphedDecoder, check_graph_setting
from asyncgrpo.trainer.heap import frozen_heap
from asyncgrpo.trainer.inputs import check_dataset, check_train_inputs
from asyncgrpo.trainer.model_support import check_model_support
from asyncgrpo.trainer.moe import experts_per_token, is_moe, resolve_router_aux_coef, router_aux_loss
from asyncgrpo.trainer.moe_replay import build_router_replay
from asyncgrpo.trainer.packed_forward import PackedForward, causal_lm_of, packed_forward, settle_tree_backend
from asyncgrpo.trainer.packed_loss import loss_settings, packed_policy_loss
from asyncgrpo.trainer.ranks import broadcast_from_zero, scatter_from_zero
from asyncgrpo.trainer.rollout_source import RolloutSource
from asyncgrpo.trainer.server_setup import ServerFacts
from asyncgrpo.trainer.setup import build_parts, check_plugins, read_servers, spawn_worker_ahead
from asyncgrpo.trainer.step_loader import StepLoader, step_loader_for
from asyncgrpo.trainer.step_rows import split_rows
from asyncgrpo.trainer.step_stats import PassClock, StepStats
from asyncgrpo.trainer.warmup import can_warm_up_before_train, finish_step_graphs, prepare_step, warm_up, warmup_budget
from asyncgrpo.trainer.worker_settings import build_rollout_settings, config_extra_fields
from asyncgrpo.weights.base import WeightSync
from asyncgrpo.weights.policy import is_peft_model

logger = logging.getLogger(__name__)

COMPACT_DOCTOR_EVERY = 10  # compact_log: the run doctor's verdicts every this many windows (as asyncgrpo train)


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO trainer (see the module docstring).

    Args:
        model: a hub id, a local checkpoint directory or a ``PreTrainedModel``.
        reward_funcs: module-level callables (sync or ``async def``) returning one float or None per completion.
        args: an ``AsyncGRPOConfig``.
        train_dataset: rows with a conversational ``prompt`` column; other columns reach the reward functions.
        processing_class: the tokenizer (default: loaded from ``model``).
        callbacks, optimizers: as in ``transformers.Trainer``.
        peft_config: a PEFT config; the server receives merged weights, or only the adapter when it runs with
            ``--enable-lora`` (adapter sync, ``weights/lora_sync.py``, chosen in ``trainer/setup.py``).
        tools: module-level functions (sync or ``async def``, typed, Google-style docstrings) the model may call.
        environment_factory: a class/callable making an environment (``reset``, optional ``get_reward``, public
            methods as tools), or a dict name -> factory routed by the dataset's ``environment`` column. Without
            ``train_dataset`` the environment's ``reset()`` returns each prompt and ``max_steps`` sets the length.
        eval_dataset: held-out conversational prompts (reward columns as in ``train_dataset``), generated on the
            server in one turn and scored by the reward functions at ``eval_steps`` (``eval/*``, ``asyncgrpo.tasks.evaluate``);
            or a dict of named sets (``{name: EvalSet(...)}``, ``tasks/eval_sets.py``), logged as ``eval/<name>/*``;
            a set with an ``environment_factory`` or ``tools`` runs its episodes through ``loop_cls``'s tool loop.
        rollout_worker, weight_transfer: TRL 1.16's ``RolloutWorkerProtocol`` / ``WeightTransferProtocol`` objects,
            used instead of ours (``trainer/trl_worker.py``, ``trainer/trl_weights.py``; docs/usage.md).
    """

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    lora_prefix: str = "asyncgrpo-lora"  # adapter sync: the server gets adapters <lora_prefix>-step-<N>

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned child re-importing the user's script
            raise RuntimeError(GUARD_HINT)
        args = args if args is not None else AsyncGRPOConfig(output_dir="asyncgrpo-output")
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"args must be an AsyncGRPOConfig, got {type(args).__name__}")
        start_compile_workers(args, peft=peft_config is not None)  # they come up while the model loads
        model_id = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "policy")
        if isinstance(model, str):
            init_kwargs = {"dtype": args.dtype, "trust_remote_code": args.trust_remote_code}
            init_kwargs.update(args.model_init_kwargs or {})
            model = vlm.load_pretrained(model, **init_kwargs)  # image-text class for vision-language checkpoints
        check_model_support(model)  # layers tree packing cannot follow (sliding windows, sinks, unknown recurrences)
        text_config = getattr(model.config, "text_config", None) or model.config  # a VLM's MoE lives in its text model
        self.router_aux_coef = resolve_router_aux_coef(text_config, args.router_aux_loss_coef)  # L6; 0 = off
        self.router_top_k = experts_per_token(text_config)
        self.router_replay = build_router_replay(model, args.router_replay, args.wants_routed_experts)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code,
                                                             **local_only(model_id))  # fmt: skip
        if peft_config is not None:
            from peft import get_peft_model

            targets = getattr(peft_config, "target_modules", None) or []
            if "lm_head" in (targets if isinstance(targets, (list, set, tuple)) else [targets]):
                raise ValueError("LoRA on lm_head is not supported: drop 'lm_head' from peft_config.target_modules")
            model = get_peft_model(model, peft_config)
        vlm.freeze_non_text(model)  # T4: tower/projector frozen (no grads, no optimizer state, not synced)
        reward_funcs = (
            [] if reward_funcs is None else (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
        )
        for f in reward_funcs:
            if isinstance(f, str):
                raise TypeError(f"reward function {f!r} is a string; pass a callable (import it in your script)")
            check_picklable(f, "reward function")
        tools, factories, train_dataset = check_train_inputs(tools, environment_factory, train_dataset, args.max_steps)
        for f in reward_funcs:  # a wrong signature fails here, not at the first scored group minutes later
            check_reward_signature(f, dataset_columns(train_dataset) if train_dataset is not None else [])
        if tools or factories:  # A3: a template that shows the tools and re-renders turns as extensions
            prepare_tool_template(processing_class, args.chat_template_kwargs)
        self.tools, self.environment_factory = tools, factories
        if eval_dataset is not None:  # a row needs a conversational 'prompt' unless an eval set's environment makes it
            sets = as_eval_sets(eval_dataset)
            for s in sets.values() if sets else [EvalSet(eval_dataset)]:
                check_dataset(s.dataset, s.factories())
        check_plugins(rollout_worker, weight_transfer)  # a missing method is named here, not at train()
        self.rollout_worker, self.weight_transfer = rollout_worker, weight_transfer
        self.model_id = model_id
        self.reward_funcs = reward_funcs
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        use_tree_attention(self._causal_lm())
        settle_tree_backend(self, args.token_budget)  # one the device cannot run is refused here
        compile_for_training(self._causal_lm(), args, is_peft_model(model), self.router_replay)  # after get_peft_model
        check_graph_setting(self)  # cuda_graph_step=True where it cannot run: said now, not at train()
        self.window = MetricsWindow()
        self.step_stats = StepStats()
        self.add_callback(AsyncGRPOCallback(self))
        self.add_callback(MetricsFileCallback(self))
        if args.compact_log:  # the command line's readable line per window, for scripts too
            from asyncgrpo.report.live import CompactProgress, install_compact_progress, settings_of

            install_compact_progress(self, CompactProgress(COMPACT_DOCTOR_EVERY, settings_of(args)))
        funcs = [reward_function_name(f) for f in reward_funcs]
        moe = is_moe(text_config)  # the run doctor's routing table
        self.run_info: dict[str, Any] = {"model": model_id, "reward_funcs": funcs, "mixture_of_experts": moe}
        self.worker: RolloutWorker | Any = None  # rank 0, during train() (a TRLWorkerHost around rollout_worker)
        self.source: RolloutSource | None = None  # rank 0, during train()
        self.weight_sync: WeightSync | None = None  # every process, during train() (trainer/setup.py picks it)
        self.facts: ServerFacts | None = None
        self.served_adapter: str | None = None  # the newest adapter registered under adapter sync (T6), rank 0
        self.final_model_saved = False  # train() saved the final model to output_dir
        self.graphed: GraphedDecoder | None = None  # cuda_graph_step: set up by the warm-up (trainer/graphed_step.py)
        self.graphs_decided = False  # step_graphs() asked once whether this run's step can run as CUDA graphs
        self.worker_ahead: RolloutWorker | None = None  # spawned by warm_up_compile(), adopted by train()

    # ------------------------------------------------------------------ set-up

    def _causal_lm(self) -> torch.nn.Module:
        return causal_lm_of(self.model)

    def rollout_settings(self, facts: ServerFacts, start_index: int) -> RolloutSettings:
        """The rollout worker's whole view of the run, built once on rank 0 after probing the server.

        Every on/off decision is taken here (score centering: ``num_sampler_logprobs`` is None when off; the
        adapter names of adapter sync are added by ``trainer/setup.py``). Fields an ``AsyncGRPOConfig`` subclass
        adds go to ``extra`` (the loop's ``self.config``); override this method to add other values:
        ``dataclasses.replace(super().rollout_settings(...), extra={...})``.
        """
        eos = self.processing_class.eos_token_id
        return build_rollout_settings(self.args, facts, start_index, self.token_budget, eos)

    def _start_rollout(self, resume: ResumePoint) -> None:
        """Probe the servers; build the loop, source and weight sync (``trainer/setup.py``). The worker starts in
        ``start_rollout_worker``."""
        args: AsyncGRPOConfig = self.args
        self.facts = read_servers(self)
        spawn_worker_ahead(self)  # once the servers answer: its imports overlap the Trainer's set-up and first push
        self.token_budget = args.token_budget or self.facts.max_model_len
        settle_tree_backend(self, self.token_budget)  # "auto" for the run's rows
        parts = build_parts(self, self.facts, resume, self.token_budget)
        self.weight_sync, self.worker, self.source = parts.weight_sync, parts.worker, parts.source
        self.step_stats.flops_per_token = flops_per_token(self._causal_lm().config, attended_keys=self.token_budget / 2)
        if torch.cuda.is_available():
            precision = "bfloat16" if args.bf16 else "float32"
            self.step_stats.peak_flops = peak_flops(torch.cuda.get_device_name(), precision)

    def start_rollout_worker(self) -> None:
        """Start generating (rank 0), once the server holds the weights of ``global_step``: after a resume, that
        is after ``on_train_begin`` pushed the restored weights, so the first samples carry them (X3)."""
        if self.worker is not None and not self.worker.started:
            self.worker.set_policy_version(self.state.global_step)
            self.worker.start()
        # compile and capture while the worker generates the first groups, until they wait (sync_rollouts: at once)
        prepare_step(self, self.token_budget, until=self._first_samples_wait)

    def _first_samples_wait(self) -> bool:
        worker = self.worker
        return self.args.sync_rollouts or worker is None or worker.queue_size() > 0

    def warm_up_compile(self, until: Callable[[], bool] | None = None) -> float:
        """Compile the step's kernels now, while the server starts (``asyncgrpo train``); seconds spent (0: nothing to
        do). ``until`` ("the server serves") stops it at the next safe point, and ``train()`` does the rest beside the
        first generations (``trainer/warmup.py``). The rollout worker's process is spawned first (its imports)."""
        spawn_worker_ahead(self)
        if not can_warm_up_before_train(self):
            return 0.0
        return warm_up(self, warmup_budget(self), before_train=True, until=until)

    def _stop_rollout(self) -> None:
        for worker in (self.worker, self.worker_ahead):  # worker_ahead: a train() that failed before adopting it
            if worker is not None:
                worker.stop()
        if self.weight_sync is not None:
            self.weight_sync.close()
        self.worker = self.source = self.weight_sync = self.worker_ahead = None

    def _end_generation_after_last_step(self) -> None:
        """No sample generated after the last step is trained: stop the worker before the final held-out evaluation,
        so the server scores the eval prompts alone (2 CPU cores: 53 s beside unused rollouts, 30 s alone)."""
        last = self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps
        if last and self.worker is not None:
            self.window.extend(self.worker.drain_metrics())
            self.worker.stop()
            self.worker = None

    def sync_weights(self) -> None:
        """Push the current policy to the servers and hand its version to the rollout worker.

        Every process must call it (sharded parameters are gathered collectively, one full tensor at a time);
        rank 0 sends. With several processes they first meet in a barrier, which rank 0 enters once the server
        is paused: then the gathers start together, and a failed round is never replayed by rank 0 alone. What
        carries the weights (merged weights, or the adapter under adapter sync, T6) is the ``weight_sync`` that
        ``trainer/setup.py`` chose.
        """
        if self.weight_sync is None or (self.is_world_process_zero() and self.worker is None):
            raise RuntimeError("sync_weights needs the weight sync and rollout worker that train() starts")
        step = self.state.global_step
        metrics = self.weight_sync.push(self.model, step)
        if not self.is_world_process_zero():
            return
        self.served_adapter = self.weight_sync.served_model
        assert self.worker is not None
        self.worker.set_policy_version(step)  # new groups carry (and name) the new version from now on
        for name, value in metrics.items():
            self.window.add(name, value)

    def share_from_rank_zero(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process (a collective: every process calls it at the same point)."""
        return broadcast_from_zero(obj, self.args.world_size)

    # ------------------------------------------------------------------ Trainer hooks

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """Train until ``max_steps`` optimizer steps, or ``num_train_epochs`` passes over the prompts (T3).

        ``resume_from_checkpoint`` (a path, True for the newest checkpoint in ``output_dir``, or ``"auto"``: the
        newest if there is one, else a fresh start) restores the model, optimizer and scheduler, and restarts
        generation at the first untrained prompt (T5).
        """
        ckpt = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        n = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        resume = ResumePoint()
        if self.is_world_process_zero():
            resume = prepare_resume(ckpt, n, self.args.output_dir, restarted=resume_from_checkpoint == "auto")
        self.step_stats.num_tokens_total = resume.num_tokens
        with frozen_heap():  # full collections skip the heap built so far (trainer/heap.py)
            try:
                self._start_rollout(resume)
                out = super().train(resume_from_checkpoint=ckpt, **kwargs)
            except torch.OutOfMemoryError as exc:
                if getattr(self.weight_sync, "backend", None) != "ipc":
                    raise
                raise shared_gpu_oom(exc, self.args.device) from exc  # the split of the one GPU is what to change
            finally:
                self._stop_rollout()
        if self.args.save_strategy != "no" and self.args.world_size == 1:
            self.save_model(self.args.output_dir)  # X7: the final model, in output_dir (no off-grid checkpoint-N)
            self.final_model_saved = True
        return out

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (checkpoints too), then make the files readable as the umask allows."""
        super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():
            make_readable(output_dir or self.args.output_dir)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"):
        """Score the held-out prompts on the server (its weights are the last sync's); logs ``eval/*``. Agent sets
        run through ``loop_cls`` here, beside the worker's admission (``tasks/agent_eval.py``)."""
        from asyncgrpo.tasks.eval_sets import evaluate_held_out
        from asyncgrpo.tasks.evaluate import settings_from_config

        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass it to the trainer or to evaluate())")
        metrics: dict[str, float] = {}
        self._end_generation_after_last_step()
        if self.is_world_process_zero():
            settings = settings_from_config(self.args)
            if self.served_adapter is not None:  # adapter sync: the newest adapter holds the trained policy
                settings = dataclasses.replace(settings, model=self.served_adapter)
            metrics = evaluate_held_out(self.processing_class, dataset, self.reward_funcs, settings, metric_key_prefix,
                                        loop_cls=self.loop_cls, extra=config_extra_fields(self.args))  # fmt: skip
            Trainer.log(self, metrics)  # not self.log: that would flush the training window into this line
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def get_train_dataloader(self) -> StepLoader:
        return step_loader_for(self.args, self.train_dataset)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, None]:
        """One step's micro-batches for this process: ``{"row": PackedRow, "normalizer": float}`` each.

        Rank 0 pulls and plans the step (one row per process per micro-batch, balanced by the planner) and
        scatters each process its own rows; the normalizer counts the trained tokens of the whole micro-batch,
        every process's row (L5).
        """
        self.step_stats.begin()  # perf/step_s counts the wait for samples
        per_rank: list[list[dict[str, Any]]] | None = None
        if self.state.global_step >= 1:
            finish_step_graphs(self)  # buckets step 1 did not wait for (none left after step 2's)
        if self.is_world_process_zero():
            assert self.source is not None
            micro = [] if self.source.finished else self.source.next_step(self.state.global_step)
            self.step_stats.micro_batches = micro
            self.window.add("perf/rollout_wait_s", self.source.wait_s)
            packed = [mb.pack() for mb in micro]
            dropped = self.source.batcher.take_dropped_count()
            for name, value in batch_metrics(packed, self.token_budget, dropped).items():
                self.window.add(name, value)
            per_rank = split_rows(packed, self.args.gradient_accumulation_steps, self.args.world_size,
                                  self.args.loss_type, self.args.max_completion_length)  # fmt: skip
        batches = scatter_from_zero(per_rank, self.args.world_size)
        if not batches:
            self.control.should_training_stop = True
        return batches, None

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        return self.step_forward_backward(model, inputs["row"], inputs["normalizer"])

    def step_forward_backward(self, model: torch.nn.Module, row: Any, normalizer: float, keep_metrics: bool = True,
                              autocast_forward: bool = False):  # fmt: skip
        """One row's forward and backward (``keep_metrics=False``: the compile warm-up, ``trainer/warmup.py``;
        ``autocast_forward``: the model's forward under the accelerator's autocast, as a prepared model runs)."""
        model.train()
        clock = PassClock(self.args.device)  # one device sync, after the backward (trainer/step_stats.py)
        if row is None or row.num_tokens == 0:  # every process must forward (FSDP collectives): a 1-token row
            row = pack_samples([PackSample([0, 0], [0, 0], [0.0, 0.0], 0.0, -1)])
        row = row.to(self.args.device)
        replay = self.router_replay  # the sampler's routing stays set through backward (checkpointed layers re-run)
        if replay is not None:
            replay.begin(row.routed_experts)
        with self.compute_loss_context_manager():
            router: list[torch.Tensor] | None = [] if self.router_aux_coef > 0 else None
            graphs = self.graphed if replay is None and router is None else None
            fwd = graphs.forward(row) if graphs is not None and graphs.covers(row) else None  # small rows: CUDA graphs
            if fwd is None:
                with self.accelerator.autocast() if autocast_forward else contextlib.nullcontext():
                    plan = build_plan(row, self.tree_attention_backend, self.args.device)
                    fwd = packed_forward(model, row, plan, router_logits=router)
            if replay is not None:
                replay.end_forward()
            result = self._policy_loss(fwd, row, normalizer) if row.num_trained else None
            # A row without trained tokens still joins every parameter to the graph (FSDP reduces them all).
            loss = (result.loss if result is not None else 0.0) + fwd.anchor
            aux = router_aux_loss(router, row.path_count, self.router_top_k) if router and row.num_trained else None
            if aux is not None:  # trainer/moe.py: the unpacked batch's balance loss, averaged over micro-batches
                loss = loss + (self.router_aux_coef / self.args.gradient_accumulation_steps) * aux
        clock.forward_done()
        self.accelerator.backward(loss)
        if replay is not None:
            replay.end()
        seconds, forward_s = clock.finish()
        if not keep_metrics:
            return loss.detach()
        self.step_stats.add_forward_backward(seconds, row.num_tokens, forward_s)
        if aux is not None:
            self.window.add("aux_loss", float(aux.detach()))
        if result is not None:
            for name, value, weight in result.metric_events():
                if math.isfinite(value):
                    self.window.add(name, value, weight)
        return loss.detach()

    def _policy_loss(self, fwd: PackedForward, row: Any, normalizer: float):
        """LM head on the trained tokens, then the loss of ``trainer/loss.py`` (L1-L6): ``packed_policy_loss``
        (the gradient of the LM head and the hidden states is formed in the forward, chunk by chunk)."""
        settings = loss_settings(self.args)  # the family, its correction and the reference's mask band
        return packed_policy_loss(fwd.hidden[row.pred_index], fwd.head_weight, row, normalizer, settings)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """This process's row only: transformers sums ``total_flos`` over processes."""
        row = inputs.get("row") if isinstance(inputs, dict) else None
        tokens = row.num_tokens if row is not None else 0
        return int(tokens * (self.step_stats.flops_per_token or 0))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.is_world_process_zero():
            if self.worker is not None:
                self.window.extend(self.worker.drain_metrics())
            if self.source is not None:
                self.window.extend(self.source.take_metrics())
            for name, value in (self.router_replay.take_metrics() if self.router_replay else {}).items():
                self.window.add(name, value)  # moe/*: this process's rows
            logs = {**logs, **self.window.flush(), "num_tokens": self.step_stats.num_tokens_total}
        super().log(logs, start_time)
