"""Reading the namespace for the diagnosis, with real torch tensors, modules and optimizers on the CPU."""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn

from oommagic.diagnosis.context import expandable_segments_on, make_context, prompt_tokens, scan_namespace
from oommagic.diagnosis.rules import diagnose
from oommagic.diagnosis.source import BatchGuess
from oommagic.run.release import free_names
from oommagic.timeline import Recording

FLOAT = 4


def context(source: str, namespace: dict, device="cpu", batch_name=None, applied=(), **recorded):
    """The DiagnosisContext of a run of ``source`` that failed with ``namespace`` as it is."""
    scan = scan_namespace(namespace, device, source, applied)
    rec = Recording(device=device, **recorded)
    return make_context(source, rec, None, scan, batch_name=batch_name, applied=applied)


def leftovers(ctx) -> dict[str, tuple[str, int]]:
    return {lo.name: (lo.kind, lo.bytes) for lo in ctx.leftovers}


def trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(2, model.in_features)).sum().backward()
    opt.step()
    return opt


def test_leftovers_sorted_by_bytes_with_their_kinds():
    model = nn.Linear(100, 100)
    ns = {
        "small": torch.zeros(1000),
        "big": torch.zeros(1_000_000),
        "model": model,
        "opt": trained(model),
        "pair": [torch.zeros(500), torch.zeros(500)],
    }
    ctx = context("print('hello')\n", ns)
    assert [lo.name for lo in ctx.leftovers] == ["big", "opt", "model", "small", "pair"]
    held = leftovers(ctx)
    assert held["big"] == ("tensor", 1_000_000 * FLOAT)
    # params + buffers + grads; Adam: two moments per parameter plus the step counters.
    assert held["model"] == ("module", 2 * (100 * 100 + 100) * FLOAT)
    assert held["opt"][0] == "optimizer" and held["opt"][1] >= 2 * (100 * 100 + 100) * FLOAT
    assert held["pair"] == ("container", 1000 * FLOAT)


def test_views_are_not_counted_twice():
    x = torch.zeros(1_000_000)
    ns = {"x": x, "head": x[:10], "t": x.view(1000, 1000).t()}
    assert sum(lo.bytes for lo in context("", ns).leftovers) == 1_000_000 * FLOAT


def test_ipython_names_and_non_tensors_are_skipped():
    ns = {
        "_": torch.zeros(100),
        "__": torch.zeros(100),
        "_7": torch.zeros(100),
        "_i7": "x = 1",
        "Out": {7: torch.zeros(100)},
        "In": ["", "x = 1"],
        "torch": torch,
        "lr": 3e-4,
        "kept": torch.zeros(100),
    }
    assert [lo.name for lo in context("", ns).leftovers] == ["kept"]


def test_containers_are_read_one_level_deep():
    ns = {"flat": {"a": torch.zeros(100)}, "deep": [[torch.zeros(100)]]}
    assert list(leftovers(context("", ns))) == ["flat"]


def test_an_object_holding_a_model_and_optimizer_counts_as_a_container():
    class Trainer:
        def __init__(self) -> None:
            self.model = nn.Linear(10, 10)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.name = "run"

    ctx = context("trainer.train()\n", {"trainer": Trainer()})
    assert leftovers(ctx) == {"trainer": ("container", (100 + 10) * FLOAT)}
    assert [m.name for m in ctx.models] == ["trainer.model"]


def test_models_are_listed_once_with_dtype_and_training_state():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    ns = {"model": model, "layer": model[0], "loss_fn": nn.CrossEntropyLoss()}
    ctx = context("loss = model(x).sum()\nloss.backward()\n", ns)
    assert len(ctx.models) == 1
    info = ctx.models[0]
    assert info.name == "model" and info.dtype == "bfloat16" and info.is_training
    assert info.param_bytes == 2 * (64 * 64 + 64) * 2
    assert not info.is_hf and not info.supports_checkpointing


def test_a_model_in_eval_mode_or_without_backward_is_not_training():
    model = nn.Linear(8, 8)
    assert not context("y = model(x)\n", {"model": model}).models[0].is_training
    model.eval()
    assert not context("model(x).sum().backward()\n", {"model": model}).models[0].is_training


def test_batch_found_through_the_namespace():
    ctx = context("train(model, loader, bs)\n", {"bs": 32, "flag": True})
    assert ctx.batch == BatchGuess("bs", 32, "namespace")
    explicit = context("run(n)\n", {"n": 8}, batch_name="n")
    assert explicit.batch == BatchGuess("n", 8, "option")


def test_generation_settings_read_from_the_source_and_namespace():
    src = (
        "enc = tokenizer(texts, truncation=True)\n"
        "out = model.generate(**enc, max_new_tokens=n, num_beams=4)\n"
    )
    ctx = context(src, {"n": 300})
    assert ctx.generation and ctx.max_new_tokens == 300 and ctx.num_beams == 4 and ctx.has_truncation
    plain = context("out = model(x)\n", {})
    assert not plain.generation and plain.max_new_tokens is None and not plain.has_truncation


def test_the_prompt_length_is_read_from_the_generate_call():
    ids = torch.zeros(4, 37, dtype=torch.long)
    assert prompt_tokens("out = model.generate(ids, max_new_tokens=8)\n", {"ids": ids}) == 37
    assert prompt_tokens("model.generate(input_ids=ids)\n", {"ids": ids}) == 37
    assert prompt_tokens("model.generate(**enc)\n", {"enc": {"input_ids": ids}}) == 37
    assert context("out = model.generate(ids)\n", {"ids": ids}).prompt_tokens == 37
    # Built in the cell, missing, not a tensor, or unparsable: unknown.
    assert prompt_tokens("model.generate(ids[:, :5])\n", {"ids": ids}) is None
    assert prompt_tokens("model.generate(ids)\n", {}) is None
    assert prompt_tokens("model.generate(**enc)\n", {"enc": {"mask": ids}}) is None
    assert prompt_tokens("model.generate(ids\n", {"ids": ids}) is None


def test_training_arguments_flags_are_read():
    src = "args = TrainingArguments('o', bf16=True, gradient_accumulation_steps=4)\ntrainer.train()\n"
    ctx = context(src, {})
    assert ctx.autocast_on and ctx.grad_accum_name == "gradient_accumulation_steps"


def test_a_retry_under_autocast_counts_as_autocast_on():
    assert context("y = model(x)\n", {}, applied=("autocast",)).autocast_on


def test_run_figures_are_carried_over():
    ctx = context("x = 1\n", {}, before_allocated=123, capacity=456, limit=400)
    assert (ctx.before_allocated, ctx.capacity, ctx.limit, ctx.device) == (123, 456, 400, "cpu")
    assert ctx.bf16_supported and ctx.other_gpus == () and ctx.processes == ()


def test_expandable_segments_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert expandable_segments_on()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments_on()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert not expandable_segments_on()


def test_free_names_gives_memory_back():
    big = torch.zeros(2_000_000)
    alive = weakref.ref(big)
    ns = {"big": big, "keep": torch.zeros(10)}
    del big

    def held() -> int:
        tensor = alive()
        return tensor.untyped_storage().nbytes() if tensor is not None else 0

    assert free_names(ns, ["big", "not_there"], measure=held) == 2_000_000 * FLOAT
    gc.collect()
    assert alive() is None
    assert list(ns) == ["keep"]


def test_free_names_never_reports_negative_bytes():
    grows = iter([0, 100])
    assert free_names({}, [], measure=lambda: next(grows)) == 0


def test_context_feeds_the_diagnosis():
    model = nn.Linear(256, 256)
    ns = {"old": torch.zeros(50_000_000), "model": model, "batch_size": 64}
    ctx = context(
        "out = model(torch.zeros(batch_size, 256))\nout.sum().backward()\n", ns, before_allocated=201_000_000
    )
    found = diagnose(None, ctx)
    left = next(f for f in found if f.key == "leftovers")
    assert left.remedies[0].params == {"names": ["old"]}


@pytest.mark.parametrize("name", ["x", "weights"])
def test_a_leftover_holding_a_gradient_counts_it(name):
    t = torch.zeros(1000, requires_grad=True)
    t.sum().backward()
    assert leftovers(context("", {name: t})) == {name: ("tensor", 2 * 1000 * FLOAT)}


def test_a_global_read_by_a_function_the_cell_calls_is_in_use():
    ns: dict = {"model": nn.Linear(4000, 4000), "stale": torch.zeros(20_000_000)}
    exec("def train():\n    return helper()\n\ndef helper():\n    return model(None)\n", ns)
    ctx = context("train()\n", ns)
    assert {lo.name: lo.in_use for lo in ctx.leftovers} == {"model": True, "stale": False}
    left = next(f for f in diagnose(None, ctx) if f.key == "leftovers")
    assert left.remedies[0].params == {"names": ["stale"]} and "This cell uses model" in left.evidence


def test_a_cuda_run_on_a_machine_without_cuda_gathers_without_raising():
    ctx = context("y = model(x)\n", {"x": torch.zeros(10)}, device="cuda:0")
    assert ctx.leftovers == () and ctx.device == "cuda:0"
    assert not torch.cuda.is_initialized()


def test_the_state_that_stays_comes_from_what_the_cell_holds():
    """SGD without momentum keeps no state; Adam two moments; frozen parameters get neither gradients nor
    optimizer state: the fixed part of a training step is what this model and optimizer hold."""
    plain = nn.Linear(1000, 1000)  # 4,004,000 bytes of parameters
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    ctx = context("loss = plain(x).sum()\nloss.backward()\nsgd.step()\n", {"plain": plain, "sgd": sgd})
    (info,) = ctx.models
    assert info.moments == 0 and info.state_bytes == 2 * 4_004_000  # weights + gradients only

    adam_model = nn.Linear(1000, 1000)
    adam = torch.optim.Adam(adam_model.parameters())
    ctx = context("adam_model(x).sum().backward()\nadam.step()\n", {"adam_model": adam_model, "adam": adam})
    assert ctx.models[0].moments == 2 and ctx.models[0].state_bytes == 4 * 4_004_000

    frozen = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    for p in frozen[0].parameters():
        p.requires_grad_(False)
    head = torch.optim.AdamW(frozen[1].parameters())
    ctx = context("frozen(x).sum().backward()\nhead.step()\n", {"frozen": frozen, "head": head})
    (info,) = ctx.models
    trainable = 1000 * 10 * 4 + 10 * 4
    assert info.trainable_bytes == trainable
    assert info.state_bytes == info.param_bytes + 3 * trainable, "gradients + two moments of the head only"


def test_the_scan_is_silent_and_calls_no_property():
    import warnings

    class Touchy:
        """An object whose attribute access would show: a property and __getattr__ that record calls."""

        calls: ClassVar[list] = []

        def __init__(self):
            self.model = nn.Linear(10, 10)

        @property
        def expensive(self):
            Touchy.calls.append("property")
            return torch.zeros(10)

        def __getattr__(self, name):
            Touchy.calls.append(name)
            raise AttributeError(name)

    x = torch.zeros(10, requires_grad=True)
    non_leaf = x * 2  # `.grad` of a non-leaf warns in PyTorch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = context("y = thing.model(non_leaf)\n", {"thing": Touchy(), "non_leaf": non_leaf})
    assert Touchy.calls == []
    assert any(lo.name == "thing" for lo in ctx.leftovers)


def test_optimizers_are_read_with_whether_their_step_runs_foreach_and_their_parameters_bytes():
    from oommagic.diagnosis.holdings import Reader, optimizer_infos

    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    params = list(net.parameters())
    ns = {
        "asked": torch.optim.AdamW(params, foreach=True),
        "off": torch.optim.AdamW(params, foreach=False),
        "default": torch.optim.Adam(params),  # torch picks foreach for parameters on a GPU only
        "fused": torch.optim.Adam(params, foreach=False, fused=True),
        "sgd": torch.optim.SGD(params, lr=0.1, foreach=True),
        "_": torch.optim.AdamW(params, foreach=True),  # IPython's own name
    }
    infos = {o.name: o for o in optimizer_infos(ns, Reader(torch.device("cpu")))}
    assert set(infos) == {"asked", "off", "default", "fused", "sgd"}
    assert [n for n, o in infos.items() if o.foreach] == ["asked", "sgd"]
    total = sum(p.numel() * 4 for p in params)
    assert infos["asked"] == infos["asked"].__class__("asked", "AdamW", True, total, 64 * 64 * 4)
    # An optimizer on another device's parameters holds nothing here.
    assert optimizer_infos({"asked": ns["asked"]}, Reader(torch.device("meta"))) == ()


def test_an_optimizer_behind_lightnings_wrapper_is_read_through_it():
    # LightningOptimizer, like accelerate's AcceleratedOptimizer (which needs an Accelerator's process-wide
    # state to be made), serves the wrapped optimizer's param_groups through a property. Lightning is not
    # among the test dependencies: skipped where it is not installed.
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from oommagic.diagnosis.holdings import Reader, optimizer_infos

    params = list(nn.Linear(32, 32).parameters())
    lit = LightningOptimizer(torch.optim.Adam(params, foreach=True))
    infos = optimizer_infos({"lit": lit}, Reader(torch.device("cpu")))
    assert [(o.name, o.kind, o.foreach) for o in infos] == [("lit", "Adam", True)]


def test_a_model_held_by_what_the_cell_reads_is_in_use_not_a_leftover():
    import torch

    from oommagic.diagnosis.context import _used_by_calls

    class Wrapped(torch.nn.Module):  # as torch.compile's OptimizedModule holds the model it compiled
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    class Trainer:
        def __init__(self, model):
            self.model = model

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ns = {"model": model, "cmodel": Wrapped(model), "trainer": Trainer(other), "other": other, "x": 1}
    assert _used_by_calls("y = cmodel(x)", ns) >= {"model"}
    assert "other" not in _used_by_calls("y = cmodel(x)", ns)
    assert "other" in _used_by_calls("trainer.train()", ns)
