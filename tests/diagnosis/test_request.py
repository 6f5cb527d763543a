"""Naming the one allocation that failed: a candidate from the failing frames matched against the bytes
the error requested, exactly (the CPU's emulated limit) or within the CUDA allocator's 2 MiB block and the
message's two decimals; its dimensions named from the model's inputs and config."""

from __future__ import annotations

from oommagic.diagnosis.request import Candidate, Computation, match_request, name_dims
from oommagic.oom import parse_oom

MiB = 1024**2
LOGITS = Candidate((8, 512, 50257), (("bfloat16", 2), ("float32", 4)), "the output of `lm_head`", logits=True)
DIMS = (("batch", 8), ("sequence", 512), ("vocabulary", 50257), ("hidden", 768))


def test_a_cuda_message_rounded_to_the_allocators_block_names_the_logits():
    # 8 × 512 × 50,257 bf16 values are 392.63 MiB; CUDA asks for the 2 MiB block above and prints it.
    report = parse_oom(
        "CUDA out of memory. Tried to allocate 394.00 MiB. GPU 0 has a total capacity of 23.55 GiB of which "
        "100.00 MiB is free. Of the allocated memory 23.00 GiB is allocated by PyTorch, and 0 bytes is "
        "reserved by PyTorch but unallocated."
    )
    req = match_request(Computation((LOGITS,), DIMS, "logits_to_keep", "LlamaForCausalLM"), report.requested)
    assert req is not None and req.dtype == "bfloat16" and req.bytes == 8 * 512 * 50257 * 2
    assert req.shape_words() == "8 × 512 × 50,257 (batch × sequence × vocabulary) bfloat16 values"
    assert req.keep_keyword == "logits_to_keep"


def test_a_float32_copy_of_half_precision_logits_matches_at_four_bytes():
    req = match_request(Computation((LOGITS,), DIMS), 8 * 512 * 50257 * 4)
    assert req is not None and req.dtype == "float32"


def test_no_candidate_of_the_requested_size_names_nothing():
    assert match_request(Computation((LOGITS,), DIMS), 300 * MiB) is None
    assert match_request(None, 300 * MiB) is None
    assert match_request(Computation((LOGITS,), DIMS), None) is None


def test_two_candidates_of_different_sizes_within_the_rounding_name_nothing():
    other = Candidate((8, 512, 50200), (("bfloat16", 2),), "something else")
    assert match_request(Computation((LOGITS, other), DIMS), 394 * MiB) is None


def test_a_shape_named_in_part_gets_no_names():
    dims = dict(DIMS)
    assert name_dims((8, 512, 50257), dims) == ("batch", "sequence", "vocabulary")
    assert name_dims((4096, 50257), dims) == ("batch·sequence", "vocabulary")
    assert name_dims((8, 12, 512, 512), dims) == ()  # heads not in the config read


def test_logits_bound_to_a_name_and_read_at_the_last_position_are_found():
    from oommagic.diagnosis.source import last_logits_calls

    cell = (
        "with torch.no_grad():\n    logits = model(input_ids=p).logits\n"
        "next_token = logits[:, -1].argmax(-1)\n"
    )
    assert last_logits_calls(cell) == ("model",)
    # Read whole somewhere: every position is needed.
    assert last_logits_calls("logits = model(input_ids=p).logits\nprobs = logits.softmax(-1)\n") == ()
