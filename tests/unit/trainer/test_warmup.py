"""The compile warm-up: rows of the run's shapes, a real forward+backward that leaves the run untouched."""

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import smollm2_tokenizer, tiny_model
from asyncgrpo.trainer.compile import wants_compiled_layers
from asyncgrpo.trainer.graphed_step import GraphedDecoder, graph_buckets
from asyncgrpo.trainer.warmup import PROMPT_TOKENS, should_warm_up, warm_up, warmup_rows

ROWS = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(tmp_path, **kw):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
    return AsyncGRPOTrainer(tiny_model("llama"), reward_funcs=[reward], args=args, train_dataset=ROWS,
                            processing_class=smollm2_tokenizer())  # fmt: skip


def _check_row(row, target, groups, group_size, per_max):
    """Within ``target`` tokens, short of it by less than one more group could fill; ``groups`` groups of
    ``group_size`` samples whose completions are at most ``per_max`` tokens, every completion token trained."""
    assert target - (PROMPT_TOKENS + 3 * group_size) - groups < row.num_tokens <= target
    prompts = groups * PROMPT_TOKENS
    assert row.num_flat_tokens == prompts * group_size + row.num_trained
    assert row.num_trained <= groups * group_size * per_max


def test_rows_have_the_runs_shape():
    small, large = warmup_rows(token_budget=1024, num_generations=8, max_completion_length=256, vocab_size=500,
                               top_n=8)  # fmt: skip
    _check_row(small, 512, 1, 8, 256)  # one group of 8 samples fills half the budget
    _check_row(large, int(1024 * 0.95), 1, 8, 256)
    assert small.num_tokens != large.num_tokens  # two lengths: sizes that turn dynamic do so in the warm-up
    assert small.sampler_topn_ids is not None and small.sampler_topn_ids.shape[1] == 8
    # completions capped by max_completion_length: as many groups as fit; no top-N without score centering
    capped = warmup_rows(4096, 4, 16, 500, top_n=0)[1]
    groups = int(4096 * 0.95) // (PROMPT_TOKENS + 4 * (16 + 1))  # 29, and 63 tokens left: too few for another
    _check_row(capped, int(4096 * 0.95), groups, 4, 16)
    assert capped.sampler_topn_ids is None


def test_rows_of_short_completions_still_fill_their_share_of_the_budget():
    """max_completion_length 40, G=8: one group is about 390 tokens; the rows pack groups (the last one shorter)
    up to half and 95 % of the budget, so the larger row lands in the largest CUDA graph bucket, as full real
    rows do, and the smaller one in the half-budget bucket."""
    small, large = warmup_rows(1024, 8, 40, 500, top_n=0)
    _check_row(small, 512, 2, 8, 40)
    _check_row(large, int(1024 * 0.95), 3, 8, 40)
    buckets = graph_buckets(1024)
    assert buckets[-2] < large.num_tokens <= buckets[-1] and buckets[0] < small.num_tokens <= buckets[1]


def test_warm_up_leaves_weights_grads_and_metrics_alone(tmp_path):
    trainer = _trainer(tmp_path)
    assert not should_warm_up(trainer)  # CPU: nothing compiles there, the warm-up is skipped
    trainer.token_budget = 256
    trainer.model_wrapped = trainer.model
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    calls = []
    real = trainer.step_forward_backward

    def spy(model, row, normalizer, keep_metrics=True, autocast_forward=False):
        calls.append((row.num_tokens, keep_metrics))
        loss = real(model, row, normalizer, keep_metrics=keep_metrics, autocast_forward=autocast_forward)
        assert any(p.grad is not None for p in model.parameters())  # a real backward ran
        return loss

    trainer.step_forward_backward = spy
    assert warm_up(trainer, trainer.token_budget) > 0
    assert [k for _, k in calls] == [False, False] and calls[0][0] < calls[1][0]
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert trainer.window.flush() == {} and trainer.step_stats.forwarded_tokens == 0


def test_compiled_layers_by_default_only_where_measured(tmp_path):
    class Args:
        compile_decoder_layers = None
        device = "cpu"
        world_size = 1

    assert not wants_compiled_layers(Args, peft=False, router_replay=None)  # CPU: eager
    Args.compile_decoder_layers = True
    assert wants_compiled_layers(Args, peft=True, router_replay=None)  # an explicit choice wins
    Args.compile_decoder_layers, Args.device = None, "cuda"
    assert not wants_compiled_layers(Args, peft=True, router_replay=None)
    assert not wants_compiled_layers(Args, peft=False, router_replay=object())


def test_a_warm_up_before_train_compiles_what_the_prepared_model_runs(tmp_path):
    """asyncgrpo train warms up before train() (the server still starting): the model is not prepared yet, so the
    warm-up runs its forward under the accelerator's autocast. The prepared model's first real step must then find
    every graph compiled: no new dynamo graph."""
    from torch._dynamo.utils import counters

    from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers

    trainer = _trainer(tmp_path, bf16=True, compile_decoder_layers=False)
    torch._dynamo.reset()
    compile_decoder_layers(trainer.model, CompileSettings(backend="aot_eager"))  # the guards inductor's would have
    assert warm_up(trainer, 256, before_train=True) > 0 and trainer.compile_warmed_up
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the warm-up compiled the layers
    prepared = trainer.accelerator.prepare(trainer.model)  # what train() does: forward under autocast from now on
    row = warmup_rows(200, 4, 24, trainer.model.config.vocab_size, top_n=8)[1]
    trainer.step_forward_backward(prepared, row, float(row.num_trained))
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled for the real step
    assert not should_warm_up(trainer)  # train() skips its own warm-up


def test_warm_up_compile_spawns_the_rollout_worker_ahead(tmp_path):
    """Its imports then run while the trainer compiles and the server starts; train() adopts it (the CLI train
    tests run that path end to end)."""
    trainer = _trainer(tmp_path)
    assert trainer.worker_ahead is None
    try:
        assert trainer.warm_up_compile() == 0.0  # CPU: nothing to compile, but the worker is spawned
        first = trainer.worker_ahead
        assert first is not None and first.process.is_alive() and not first.started
        trainer.warm_up_compile()
        assert trainer.worker_ahead is first  # once
    finally:
        trainer.worker_ahead.stop()
    assert trainer.worker_ahead.process.exitcode == 0


def test_cuda_graph_step_true_where_it_cannot_run_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="cuda_graph_step=True needs a CUDA device"):
        _trainer(tmp_path, cuda_graph_step=True)


def _record_rows(trainer):
    """The token counts of the rows the trainer's step runs from now on (the real step still runs)."""
    rows = []
    real = trainer.step_forward_backward

    def spy(model, row, normalizer, keep_metrics=True, autocast_forward=False):
        rows.append(row.num_tokens)
        return real(model, row, normalizer, keep_metrics=keep_metrics, autocast_forward=autocast_forward)

    trainer.step_forward_backward = spy
    return rows


def test_a_warm_up_stops_where_asked_and_train_finishes_it(tmp_path):
    """``until`` (asyncgrpo train: "the server serves") is asked before the warm-up and between its parts; a stopped
    warm-up leaves ``compile_warmed_up`` unset, so ``train()`` runs it (whole) beside the first generations."""
    trainer = _trainer(tmp_path)
    trainer.model_wrapped = trainer.model
    rows = _record_rows(trainer)
    assert warm_up(trainer, 256, until=lambda: True) == 0.0 and rows == []  # serving already: nothing here
    answers = iter([False, False, True])  # before the warm-up, before row 1, before row 2
    assert warm_up(trainer, 256, until=lambda: next(answers)) > 0
    assert len(rows) == 1 and not getattr(trainer, "compile_warmed_up", False)
    assert all(p.grad is None for p in trainer.model.parameters())
    warm_up(trainer, 256)  # train()'s turn
    assert len(rows) == 3 and trainer.compile_warmed_up


def _counted_graphs(sizes, fails_check=False):
    """A GraphedDecoder whose capture and check only record what they were asked (the GPU suite runs real ones)."""
    graphs = GraphedDecoder.__new__(GraphedDecoder)
    graphs.sizes, graphs.buckets, graphs.failed, graphs.verified = list(sizes), {}, None, False
    graphs.checked = []

    def check(row):
        graphs.checked.append((row, sorted(graphs.buckets)))
        graphs.verified = True
        if fails_check:
            graphs.failed = "disagrees"
            graphs.buckets.clear()

    graphs._capture_or_fail = lambda size, reference=None: graphs.buckets.setdefault(size, size)
    graphs._verify_or_fail = check
    return graphs


def test_graph_capture_goes_largest_first_checks_the_first_capture_and_stops_where_asked():
    """Rows are packed up to the budget, so the largest bucket comes first and is the one checked; ``until`` is asked
    before each capture (from the second on with ``at_least_one``), and :meth:`missing` says what is left."""
    graphs = _counted_graphs([128, 256, 384, 512])
    graphs.capture_all(verify_row="row", until=lambda: True)
    assert list(graphs.buckets) == [512] and graphs.checked == [("row", [512])] and not graphs.complete()
    graphs.capture_all(until=lambda: True, at_least_one=False)
    assert list(graphs.buckets) == [512]  # samples wait already: nothing captured
    answers = iter([False, True])  # asked before 256 and before 128
    graphs.capture_all(until=lambda: next(answers))
    assert list(graphs.buckets) == [512, 384, 256] and graphs.missing() == [128]
    graphs.capture_all(verify_row="row")
    assert graphs.missing() == [] and graphs.complete() and len(graphs.checked) == 1  # checked once
    assert graphs.capture_largest("row") == 0.0  # there already
    graphs.failed = "off"
    assert graphs.complete() and graphs.missing() == []  # graphs turned off: nothing left to do either


def test_a_graph_that_fails_its_check_is_not_captured_again_for_every_bucket():
    graphs = _counted_graphs([128, 256, 384, 512], fails_check=True)
    graphs.capture_largest("row")
    assert graphs.checked == [("row", [512])] and graphs.failed and graphs.buckets == {}
    graphs.capture_all()
    assert graphs.buckets == {} and graphs.complete()


def test_step_one_does_not_wait_for_the_smaller_buckets_and_step_two_captures_them(tmp_path):
    """prepare_step (train()'s start) captures buckets until the first samples wait; finish_step_graphs (called
    before each step after the first) captures what is left, so no later step pays for a capture."""
    from asyncgrpo.trainer.graphed_step import graph_buckets
    from asyncgrpo.trainer.warmup import finish_step_graphs, prepare_step

    trainer = _trainer(tmp_path)
    trainer.graphed, trainer.graphs_decided = _counted_graphs(graph_buckets(1024)), True
    waiting = iter([False, True])  # the first samples arrive during the second bucket's capture
    prepare_step(trainer, 1024, until=lambda: next(waiting))
    assert list(trainer.graphed.buckets) == [1024] and trainer.graphed.missing() == [256, 512, 768]
    finish_step_graphs(trainer)
    assert trainer.graphed.missing() == []
    finish_step_graphs(trainer)  # nothing left: no capture
    assert list(trainer.graphed.buckets) == [1024, 768, 512, 256]


class _Worker:
    def __init__(self, queued):
        self.queued = queued

    def queue_size(self):
        return self.queued


def test_the_first_samples_wait_when_the_worker_has_queued_some_or_generates_only_on_demand(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.worker = _Worker(0)
    assert not trainer._first_samples_wait()
    trainer.worker = _Worker(3)
    assert trainer._first_samples_wait()
    sync = _trainer(tmp_path, sync_rollouts=True)
    sync.worker = _Worker(0)
    assert sync._first_samples_wait()  # a sync_rollouts worker generates once step 1 asks: nothing to wait for


def test_the_warm_up_inside_train_stops_once_the_first_samples_wait(tmp_path, monkeypatch):
    """prepare_step() hands the warm-up its ``until`` ("the first samples wait"): step 1 then compiles what is left
    instead of waiting for the warm-up's second row (CPU: should_warm_up forced, no graphs)."""
    from asyncgrpo.trainer import warmup

    trainer = _trainer(tmp_path)
    trainer.model_wrapped = trainer.model
    monkeypatch.setattr(warmup, "should_warm_up", lambda t: not getattr(t, "compile_warmed_up", False))
    rows = _record_rows(trainer)
    answers = iter([False, False, True])  # before the warm-up, before row 1, before row 2
    warmup.prepare_step(trainer, 256, until=lambda: next(answers, True))
    assert len(rows) == 1 and not getattr(trainer, "compile_warmed_up", False)
    warmup.prepare_step(trainer, 256)  # nobody waits: the whole warm-up
    assert len(rows) == 3 and trainer.compile_warmed_up
