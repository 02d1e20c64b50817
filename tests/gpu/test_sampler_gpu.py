"""The device sampler on CUDA: the same tokens as the CPU bit for bit, and one CUDA graph.

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu/test_sampler_gpu.py
-q``.
"""

from __future__ import annotations

import pytest
import torch

from v41plan.runtime.sampler import (
    SamplerInputs,
    counter_gumbel,
    kept_mask,
    penalty_rows,
    record_tokens,
    sample_tokens,
)
from v41plan.serving.sampling import SamplingParams, sampler_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=50),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=1e-6),
    SamplingParams(temperature=5.0, top_p=0.999),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, presence_penalty=1.0),
]


def _batch(vocab: int, rows: int, seed: int):
    """Logits ``[rows, vocab]`` with ties and -inf, params cycling through MODES, histories."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, :5] = logits[:, 5:10]  # ties
    logits[1, vocab // 2 :] = float("-inf")
    params = [MODES[i % len(MODES)] for i in range(rows)]
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen).tolist()
    idx = torch.randint(0, 4096, (rows,), generator=gen).tolist()
    hist = [
        (
            torch.randint(0, vocab, (40,), generator=gen).tolist(),
            torch.randint(0, vocab, (i % 17,), generator=gen).tolist(),
        )
        for i in range(rows)
    ]
    return logits, params, seeds, idx, hist


def _to(inp: SamplerInputs, device) -> SamplerInputs:
    return SamplerInputs(**{k: (None if v is None else v.to(device)) for k, v in vars(inp).items()})


@pytest.mark.parametrize(("vocab", "rows"), [(1000, 64), (129280, 24)])
def test_cuda_tokens_equal_cpu_bit_for_bit(vocab, rows):
    logits, params, seeds, idx, hist = _batch(vocab, rows, vocab)
    cpu_in = sampler_inputs(params, seeds, idx, histories=hist, vocab_size=vocab)
    cpu = sample_tokens(logits, cpu_in, top_n=8)
    gpu = sample_tokens(logits.cuda(), _to(cpu_in, "cuda"), top_n=8)
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.equal(
        counter_gumbel(cpu_in.seed.cuda(), cpu_in.output_index.cuda(), vocab).cpu(),
        counter_gumbel(cpu_in.seed, cpu_in.output_index, vocab),
    )
    assert torch.equal(
        kept_mask(logits.cuda(), _to(cpu_in, "cuda")).cpu(), kept_mask(logits, cpu_in)
    )
    # log_softmax is libm and a float sum: equal to rounding, not bit for bit.
    torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu.top_logprobs.cpu(), cpu.top_logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(gpu.top_ids.cpu(), cpu.top_ids)


def test_sampler_captures_in_one_cuda_graph():
    vocab, rows, slots = 4096, 16, 20
    _, params, seeds, idx, hist = _batch(vocab, rows, 1)
    built = sampler_inputs(params, seeds, idx, histories=hist, vocab_size=vocab)
    counts = torch.zeros(slots, vocab, dtype=torch.int32, device="cuda")
    prompt = torch.zeros(slots, vocab, dtype=torch.bool, device="cuda")
    slot_ids = torch.arange(rows, device="cuda") + 2
    counts[slot_ids] = built.output_counts.cuda()
    prompt[slot_ids] = built.prompt_mask.cuda()
    static_logits = torch.zeros(rows, vocab, device="cuda")
    static = _to(built, "cuda")
    static_slots = slot_ids.clone()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        static.output_counts, static.prompt_mask = penalty_rows(counts, prompt, static_slots)
        out = sample_tokens(static_logits, static, top_n=4)
        record_tokens(counts, static_slots, out.token_ids)
        return out.token_ids, out.logprobs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(side)
    counts[slot_ids] = built.output_counts.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = step()
    counts[slot_ids] = built.output_counts.cuda()  # capture ran nothing, but be explicit

    for round_ in range(3):
        new_logits, *_ = _batch(vocab, rows, 100 + round_)
        static_logits.copy_(new_logits.cuda())
        static.output_index.add_(1)
        before = counts.clone()
        graph.replay()
        torch.cuda.synchronize()
        eager_in = SamplerInputs(**vars(static))
        eager_in.output_counts, eager_in.prompt_mask = penalty_rows(before, prompt, static_slots)
        eager = sample_tokens(static_logits, eager_in, top_n=4)
        assert torch.equal(tokens, eager.token_ids)
        assert torch.equal(logprobs, eager.logprobs)
        after = before.clone()
        after[static_slots, eager.token_ids] += 1
        assert torch.equal(counts, after)
