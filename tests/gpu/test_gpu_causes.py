"""Issue 12's causes on a real GPU: the parts CPU mode cannot show.

- An out-of-memory error in a plain cell (no ``%%gpumem``) pins its frames' tensors: ``%gpumem`` lists the
  pin, ``%gpumem --free`` gives the memory back, measured by ``torch.cuda.memory_allocated``.
- Inference with autograd on, on CUDA: the ``inference_mode`` rewrite turns a real CUDA OOM into a fit.
- Memory kept across iterations on CUDA: ``.detach().cpu()`` moves it off the card.
- The offloaded KV cache of transformers generates where the dynamic cache ran out (skipped without
  transformers).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import oommagic
from oommagic.run.session import session_for

pytestmark = pytest.mark.gpu
MiB, GiB = 1024**2, 1024**3


def last_run():
    return oommagic.history()[-1]


@contextlib.contextmanager
def dropped_after(shell, *names: str):
    """The names a test binds in the shell, dropped when it ends, whatever happened."""
    try:
        yield
    finally:
        for name in names:
            shell.user_ns.pop(name, None)


def fix_of(run, kind: str):
    return next(r for f in run.findings for r in f.remedies if r.kind == kind and r.automatic)


def first_entry_fits(shell, cell, source: str, kind: str):
    """Run ``source`` (a %%gpumem cell that runs out), check the plan's first entry is ``kind`` and fits,
    press it; returns the failed run and the retry, which ran without error."""
    cell(source)
    run = last_run()
    assert run.outcome == "oom", run.headline()
    print([e.line() for e in run.plan.entries])
    for finding in run.findings:
        print(f"{finding.key}: {finding.evidence} {[r.kind for r in finding.remedies]}")
    first = run.plan.entries[0]
    assert first.kind == kind and first.verdict == "fits"
    new = session_for(shell).retry(run, first.fixes[0])
    print(new.headline())
    assert new.outcome == "ok"
    return run, new


def test_a_plain_cells_oom_pins_memory_and_gpumem_free_gives_it_back(shell, cell):
    cell(
        "def fill_plain(n):\n"
        "    held = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
        "    more = torch.empty(10 * n, dtype=torch.uint8, device='cuda')\n"
        "torch.cuda.set_per_process_memory_fraction(0.5)\n"
        "free_now = torch.cuda.mem_get_info()[0]\n"
    )
    before = torch.cuda.memory_allocated()
    n = int(0.3 * torch.cuda.get_device_properties(0).total_memory)
    result = cell(f"fill_plain({n})")  # no %%gpumem: IPython keeps the traceback in sys.last_value
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    pinned = torch.cuda.memory_allocated() - before
    print(f"pinned by the plain cell's traceback: {pinned / GiB:.2f} GiB")
    assert pinned >= n
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        shell.run_cell("%gpumem")
    print(cap.stdout)
    listed = cap.stdout
    with capture_output() as cap:
        shell.run_cell("%gpumem --free")  # first: a failed assertion must not leave 24 GiB to the next tests
    print(cap.stdout)
    # Python 3.12 keeps the error as sys.last_exc, earlier ones as sys.last_value.
    assert "(OutOfMemoryError) → traceback → fill_plain() → local 'held'" in listed
    assert "sys.last_exc" in listed or "sys.last_value" in listed
    assert "given back on cuda:" in cap.stdout
    assert torch.cuda.memory_allocated() - before <= 2 * MiB


def test_inference_with_autograd_on_fits_under_inference_mode(shell, cell):
    cell(
        "deep_gpu = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096), torch.nn.ReLU()] * 16).cuda()\n"
        "x_gpu = torch.randn(8192, 4096, device='cuda')\n"
    )
    try:
        # Weights 1 GiB, the input 128 MiB: 16 layers' activations with their graph do not fit 2 GiB more.
        cell(
            "%%gpumem --limit 2GiB --plan-budget 0 --quiet\nout_gpu = deep_gpu(x_gpu)\nprint(out_gpu.shape)\n"
        )
        run = last_run()
        assert run.outcome == "oom", run.headline()
        assert "autograd" in {f.key for f in run.findings}
        new = session_for(shell).retry(run, fix_of(run, "no_grad"))
        print(new.headline())
        assert new.outcome == "ok"
    finally:
        for name in ("deep_gpu", "x_gpu", "out_gpu"):
            shell.user_ns.pop(name, None)
        shell.run_line_magic("gpumem", "--free")


def test_outputs_kept_across_iterations_move_to_the_host(shell, cell):
    cell(
        "head_gpu = torch.nn.Linear(4096, 4096).cuda()\n"
        "xs_gpu = [torch.randn(4096, 4096, device='cuda') for _ in range(2)]\n"
    )
    body = (
        "outs_gpu = []\nwith torch.no_grad():\n    for i in range(200):\n"
        "        outs_gpu.append(head_gpu(xs_gpu[i % 2]))\n"
    )
    with dropped_after(shell, "head_gpu", "xs_gpu", "outs_gpu"):
        cell(f"%%gpumem --limit 4GiB --plan-budget 0 --quiet\n{body}")
        run = last_run()
        assert run.outcome == "oom", run.headline()
        new = session_for(shell).retry(run, fix_of(run, "keep_numbers"))
        print(new.headline())
        assert new.outcome == "ok" and shell.user_ns["outs_gpu"][0].device.type == "cpu"


def test_an_optimizer_step_that_runs_out_on_cuda_steps_one_tensor_at_a_time_and_fits(shell, cell):
    # 512 MiB of parameters on the GPU: weights, gradients and AdamW's moments take 2 GiB; the foreach step
    # (torch's default here) adds 512 MiB of square roots at once, one tensor at a time 64 MiB.
    cell(
        "torch.manual_seed(0)\n"
        "wide_gpu = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()\n"
        "wide_opt = torch.optim.AdamW(wide_gpu.parameters(), lr=1e-4)\n"
        "x_wide = torch.randn(64, 4096, device='cuda')\n"
    )
    with dropped_after(shell, "wide_gpu", "wide_opt", "x_wide"):
        cell(
            "%%gpumem --limit 2.4GiB --quiet\n"
            "for _ in range(2):\n"
            "    wide_gpu(x_wide).square().mean().backward()\n"
            "    wide_opt.step()\n"
            "    wide_opt.zero_grad(set_to_none=True)\n"
        )
        run = last_run()
        assert run.outcome == "oom", run.headline()
        finding = next(f for f in run.findings if f.key == "optimizer_step")
        print(finding.evidence)
        print([e.line() for e in run.plan.entries])
        first = run.plan.entries[0]
        assert first.kind == "step_per_tensor" and first.verdict == "fits"
        assert all(g["foreach"] is None for g in shell.user_ns["wide_opt"].param_groups), "trials restored"
        new = session_for(shell).retry(run, first.fixes[0])
        print(new.headline())
        assert new.outcome == "ok"


def test_a_model_called_on_a_whole_tensor_on_cuda_runs_on_chunks_of_rows_and_fits(shell, cell):
    # 65,536 rows through an 8192-wide layer at once: 2 GiB per layer output beside 300 MiB of weights.
    cell(
        "torch.manual_seed(0)\n"
        "scorer_gpu = torch.nn.Sequential(\n"
        "    torch.nn.Linear(1024, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8192), torch.nn.ReLU(),\n"
        "    torch.nn.Linear(8192, 10)).cuda().eval()\n"
        "X_gpu = torch.randn(65536, 1024, device='cuda')\n"
    )
    with dropped_after(shell, "scorer_gpu", "X_gpu", "scores_gpu"):
        first_entry_fits(
            shell,
            cell,
            "%%gpumem --limit 2GiB --quiet\nwith torch.no_grad():\n    scores_gpu = scorer_gpu(X_gpu)\n",
            "split_rows",
        )
        # Checked after the fix: the whole call's 2 GiB outputs, freed to the cache before the failing
        # cell, would leave a segment a small tensor pins (above the limit, unusable for 2 GiB).
        got = shell.user_ns["scores_gpu"]
        with torch.no_grad():
            expected = shell.user_ns["scorer_gpu"](shell.user_ns["X_gpu"][:4096])
        diff = (got[:4096] - expected).abs().max().item()
        print(f"largest difference from a call on the first rows: {diff:.3g}")
        assert got.shape == (65536, 10) and torch.allclose(got[:4096], expected, rtol=1e-4, atol=1e-4)


def test_nearest_neighbours_on_cuda_run_on_chunks_of_queries_and_fit(shell, cell):
    # 32,768 queries × 65,536 points of float32 distances: one 8 GiB request over a 4 GiB card.
    cell(
        "torch.manual_seed(0)\n"
        "Xdb_gpu = torch.randn(65536, 128, device='cuda')\n"
        "Xq_gpu = torch.randn(32768, 128, device='cuda')\n"
    )
    with dropped_after(shell, "Xdb_gpu", "Xq_gpu", "nearest_gpu"):
        _, new = first_entry_fits(
            shell,
            cell,
            "%%gpumem --limit 4GiB --quiet\nnearest_gpu = torch.cdist(Xq_gpu, Xdb_gpu).argmin(dim=1)\n",
            "split_rows",
        )
        assert new.peak_allocated <= 4 * 2**30
        expected = torch.cdist(shell.user_ns["Xq_gpu"][:1024], shell.user_ns["Xdb_gpu"]).argmin(dim=1)
        assert torch.equal(shell.user_ns["nearest_gpu"][:1024], expected)


def test_a_similarity_matrix_larger_than_the_card_on_cuda_fits_in_half_precision(shell, cell):
    # 40,000 × 40,000 float32 similarities: one 6 GiB request over a 4 GiB card; in bfloat16, 3 GiB.
    cell(
        "torch.manual_seed(0)\n"
        "emb_gpu = torch.nn.functional.normalize(torch.randn(40000, 256, device='cuda'), dim=1)\n"
    )
    with dropped_after(shell, "emb_gpu", "sims_gpu"):
        first_entry_fits(
            shell, cell, "%%gpumem --limit 4GiB --quiet\nsims_gpu = emb_gpu @ emb_gpu.T\n", "autocast"
        )
        assert shell.user_ns["sims_gpu"].dtype == torch.bfloat16


def test_features_of_a_transformers_encoder_on_cuda_run_on_chunks_of_rows_and_fit(shell, cell):
    pytest.importorskip("transformers")
    # 16,384 sequences of 512 tokens through a 4-layer GPT-2 at once: 8 GiB per layer's activations.
    cell(
        "from transformers import GPT2Config, GPT2Model\n"
        "torch.manual_seed(0)\n"
        "config_gpu = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=512)\n"
        "enc_gpu = GPT2Model(config_gpu).cuda().eval()\n"
        "ids_gpu = torch.randint(0, 8192, (16384, 512), device='cuda')\n"
    )
    with dropped_after(shell, "enc_gpu", "ids_gpu", "feats_gpu", "config_gpu"):
        source = (
            "%%gpumem --limit 4GiB --quiet\n"
            "with torch.no_grad():\n"
            "    feats_gpu = enc_gpu(input_ids=ids_gpu).last_hidden_state.mean(dim=1)\n"
        )
        first_entry_fits(shell, cell, source, "split_rows")
        assert shell.user_ns["feats_gpu"].shape == (16384, 256)


def test_full_batch_training_on_cuda_runs_each_step_on_micro_batches_and_makes_the_same_update(shell, cell):
    # 65,536 rows through two 4096-wide layers in one step: 1 GiB per layer output, about 4 GiB of
    # activations beside 80 MiB of weights, over a 2 GiB limit.
    cell(
        "torch.manual_seed(0)\n"
        "net_gpu = torch.nn.Sequential(\n"
        "    torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),\n"
        "    torch.nn.Linear(4096, 10)).cuda()\n"
        "X_all_gpu = torch.randn(65536, 1024, device='cuda')\n"
        "y_all_gpu = torch.randint(0, 10, (65536,), device='cuda')\n"
    )
    import copy

    names = ("net_gpu", "X_all_gpu", "y_all_gpu", "opt_gpu", "pred", "loss")
    with dropped_after(shell, *names):
        reference = copy.deepcopy(shell.user_ns["net_gpu"])
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(
                reference(shell.user_ns["X_all_gpu"]), shell.user_ns["y_all_gpu"]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        del loss, opt
        torch.cuda.empty_cache()
        source = (
            "%%gpumem --limit 2GiB --quiet\n"
            "opt_gpu = torch.optim.SGD(net_gpu.parameters(), lr=0.1)\n"
            "for epoch in range(2):\n"
            "    pred = net_gpu(X_all_gpu)\n"
            "    loss = torch.nn.functional.cross_entropy(pred, y_all_gpu)\n"
            "    opt_gpu.zero_grad()\n"
            "    loss.backward()\n"
            "    opt_gpu.step()\n"
        )
        _, new = first_entry_fits(shell, cell, source, "batch")
        assert "X_all_gpu.tensor_split(" in new.source and new.peak_reserved <= 2 * GiB
        worst = max(
            (got - want).abs().max().item()
            for got, want in zip(shell.user_ns["net_gpu"].parameters(), reference.parameters(), strict=True)
        )
        print(f"largest difference from the full-batch steps: {worst:.3g}")
        for got, want in zip(shell.user_ns["net_gpu"].parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
