"""Generation whose knobs the cell's text does not show: ``generate`` settings in a dict made in an earlier
cell and splatted into the call (beam search with ``num_return_sequences`` on an encoder–decoder, sampling
with several sequences per prompt on a decoder-only model), and a hand-written decoding loop over
``past_key_values`` inside a notebook function the cell calls with its batch of prompts. Each cell fails
under ``--limit``; the report's first fix runs the prompts in chunks (searched until a chunk fits), pressed
it fits, and the output has every row, in order, in the shape the cell as written makes."""

from __future__ import annotations

import pytest

import oommagic
from tests.run.work import failed_and_first

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_names")


def failed_then_first_click(shell, run_cell, probe_cell: str, cell: str):
    """The limit leaves room for ``probe_cell`` (a quarter of the prompts) and a half again: the cell fails,
    and so do half of its prompts at a time. Returns the failed run, the first fix and the pressed run."""
    run_cell("%%gpumem --quiet -o probe\n" + probe_cell)
    probe = shell.user_ns["probe"]
    assert probe.outcome == "ok", probe.headline()
    limit = (probe.before_allocated + 1.5 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    failed, widget, first = failed_and_first(shell, run_cell, cell, limit)
    return failed, first, widget.click(first.kind)


BART_SETUP = """%%gpumem --quiet
from transformers import BartConfig, BartForConditionalGeneration
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
bart_config = BartConfig(vocab_size=320, d_model=64, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                         decoder_ffn_dim=128, max_position_embeddings=256, pad_token_id=1, bos_token_id=0,
                         eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
translator = BartForConditionalGeneration(bart_config).eval()
articles = {"input_ids": torch.randint(3, 320, (16, 48))}
beam_settings = {"num_beams": 4, "num_return_sequences": 2, "max_new_tokens": 8, "min_new_tokens": 8}
"""
BART_CELL = """\
with torch.no_grad():
    drafts = translator.generate(articles["input_ids"], **beam_settings)
"""


def test_beam_search_with_settings_splatted_from_an_earlier_cell_runs_the_sources_in_chunks(shell, run_cell):
    run_cell("import transformers\n" + BART_SETUP.replace("%%gpumem --quiet\n", ""))
    with __import__("torch").no_grad():
        whole = shell.ev('translator.generate(articles["input_ids"], **beam_settings)')
    failed, fix, fitted = failed_then_first_click(
        shell, run_cell, BART_CELL.replace('articles["input_ids"]', 'articles["input_ids"][:4]'), BART_CELL
    )
    gen = next(f for f in failed.findings if f.key == "generation")
    # The settings the call really got, read from the failed run, not "max_new_tokens not set".
    assert "num_beams=4" in gen.evidence and "num_return_sequences=2" in gen.evidence, gen.evidence
    titles = [e.fixes[0].title for e in failed.plan.entries]
    # Greedy search cannot return two sequences per source: beams stay at least the sequences returned.
    assert not any("greedy" in t for t in titles), titles
    assert fix.kind == "split_generate" and fix.verdict == "fits", (fix.kind, fix.verdict)
    assert fitted.outcome == "ok", fitted.headline()
    drafts = shell.user_ns["drafts"]
    assert tuple(drafts.shape) == tuple(whole.shape) == (32, 9)
    # Every source's two drafts, in the sources' order (beam search is deterministic).
    assert bool((drafts == whole).all())


GPT2_SETUP = """\
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
writer = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=400, n_positions=256)).eval()
batch = {"input_ids": torch.randint(3, 400, (16, 48)), "attention_mask": torch.ones(16, 48, dtype=torch.long)}
sampling = dict(do_sample=True, top_k=20, num_return_sequences=4, max_new_tokens=8, min_new_tokens=8,
                pad_token_id=0)
"""
SAMPLE_CELL = """\
with torch.no_grad():
    stories = writer.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **sampling)
"""


def test_sampling_several_sequences_per_prompt_with_a_settings_dict_runs_the_prompts_in_chunks(
    shell, run_cell
):
    run_cell(GPT2_SETUP)
    quarter = SAMPLE_CELL.replace('batch["input_ids"]', 'batch["input_ids"][:4]').replace(
        'batch["attention_mask"]', 'batch["attention_mask"][:4]'
    )
    failed, fix, fitted = failed_then_first_click(shell, run_cell, quarter, SAMPLE_CELL)
    gen = next(f for f in failed.findings if f.key == "generation")
    assert "max_new_tokens=8" in gen.evidence and "num_return_sequences=4" in gen.evidence, gen.evidence
    for entry in failed.plan.entries:
        # No trial crashed on a setting written twice ("got multiple values for keyword argument").
        assert "multiple values" not in (entry.note or ""), entry.line()
    assert fix.kind == "split_generate" and fix.verdict == "fits", (fix.kind, fix.verdict)
    assert fitted.outcome == "ok", fitted.headline()
    assert tuple(shell.user_ns["stories"].shape) == (16 * 4, 48 + 8)
    # The prompts come back in their order, each four times.
    prompts = shell.user_ns["batch"]["input_ids"]
    assert bool((shell.user_ns["stories"][:, :48] == prompts.repeat_interleave(4, dim=0)).all())


DECODE_SETUP = """\
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
tiny_llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512)).eval()
requests = torch.randint(3, 512, (32, 64))


def decode(model, ids, n_new):
    past, step_in, out_ids = None, ids, ids
    with torch.no_grad():
        for _ in range(n_new):
            out = model(step_in, past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_in = out.logits[:, -1].argmax(-1, keepdim=True)
            out_ids = torch.cat([out_ids, step_in], dim=1)
    return out_ids
"""
DECODE_CELL = "replies = decode(tiny_llama, requests, 8)\n"


def test_a_decoding_loop_in_a_function_of_an_earlier_cell_runs_the_prompts_in_chunks(shell, run_cell):
    run_cell(DECODE_SETUP)
    whole = shell.ev("decode(tiny_llama, requests, 8)")
    failed, fix, fitted = failed_then_first_click(
        shell, run_cell, DECODE_CELL.replace("requests,", "requests[:8],"), DECODE_CELL
    )
    found = next(f for f in failed.findings if f.key == "prompts")
    assert "calls decode() with all 32 rows of its `ids`" in found.evidence, found.evidence
    assert fix.kind == "split_calls" and fix.verdict == "fits", (fix.kind, fix.verdict)
    assert "decode" in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    replies = shell.user_ns["replies"]
    assert tuple(replies.shape) == tuple(whole.shape) == (32, 64 + 8)
    assert bool((replies == whole).all())


def test_a_function_that_reduces_over_its_rows_is_not_offered_prompts_in_chunks(shell, run_cell):
    # The batch reaches the model's forward, but the function keeps no cache and generates nothing: its
    # result (a mean over the rows) has no row per prompt, so chunks would change it.
    run_cell(
        "torch.manual_seed(0)\n"
        "encoder = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64))\n"
        "def pooled(model, X):\n    with torch.no_grad():\n        return model(X).mean(0)\n"
        "points = torch.randn(512, 64)"
    )
    run_cell("%%gpumem --limit 2MiB --quiet --no-raise --plan-budget 0\ncentre = pooled(encoder, points)\n")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    assert "prompts" not in [f.key for f in failed.findings], [f.key for f in failed.findings]
    assert all(r.kind != "split_calls" for f in failed.findings for r in f.remedies)
