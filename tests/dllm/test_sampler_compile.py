"""The static sampler (dllm.sampling.sample_static) under torch.compile (inductor, C++ on CPU) at SDAR's
vocabulary size (151,936): the two-stage vocabulary max / argmax gives torch's values and indices (ties and
NaN: the lowest index), and the compiled sampler equals the eager one with a dynamic row count (one graph
for 2, 3 and 5 rows) and with a static one (one graph per row count, none again for new data)."""

import pytest
import torch
from torch._dynamo.utils import counters

from dllm.sampling import VOCAB_CHUNK, sample_static, vocab_max

SDAR_VOCAB = 151936
MASK = SDAR_VOCAB - 1


def sampler_inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [rows, 4, V] with a greedy row, tempered rows, top-k / top-p rows; params; uniforms."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 4, SDAR_VOCAB, generator=g) * 3
    logits[0, 1, 1000] = logits[0, 1, 140000] = 99.0  # a greedy tie across chunks: the lower index wins
    table = [[1.0, 0, 1.0, 1], [0.7, 0, 1.0, 0], [1.3, 5, 0.8, 0], [1.0, 0, 0.9, 0], [1.0, 40, 1.0, 0]]
    params = torch.tensor([table[i % len(table)] for i in range(rows)], dtype=torch.float64)
    return logits, params, torch.rand(rows, 4, generator=g, dtype=torch.float64)


def test_vocab_max_is_torch_max_with_ties_and_nan():
    x = torch.randn(2, 5, SDAR_VOCAB)
    x[0, 0] = 0.0  # all tied: index 0
    x[0, 1, 5000] = x[0, 1, 150000] = 100.0  # tie across chunks
    x[0, 2, SDAR_VOCAB - 1] = 100.0  # in the padded last chunk
    x[0, 3, VOCAB_CHUNK - 1] = x[0, 3, VOCAB_CHUNK] = 50.0  # tie across a chunk boundary
    x[1, 0] = float("-inf")
    x[1, 1, 7] = x[1, 1, 3] = float("nan")  # the first NaN, as torch.argmax
    values, index = vocab_max(x)
    assert torch.equal(index, x.argmax(-1))
    assert torch.equal(values.nan_to_num(), x.amax(-1).nan_to_num())
    small = torch.randn(3, 100)
    assert torch.equal(vocab_max(small)[1], small.argmax(-1))  # one stage under the chunk width


def sample(logits: torch.Tensor, params: torch.Tensor, uniforms: torch.Tensor,
           filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_static(logits, params, uniforms, MASK, filtered)


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[0], b[0])
    assert (a[1] - b[1]).abs().max().item() < 5e-5  # fp32 log-probs around -12: a few ulps apart


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-rows", "static-rows"])
def test_compiled_sampler_at_sdar_vocab(dynamic: bool):
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(sample, fullgraph=True, dynamic=dynamic)
    # dynamic: unfiltered (greedy and temperature rows), one graph for every row count; static: a
    # bucket's shape with top-k / top-p on, one graph, then none for new data
    runs = [(2, 0, False), (3, 1, False), (5, 2, False)] if dynamic else [(2, 3, True), (2, 4, True)]
    for rows, seed, filtered in runs:
        logits, params, u = sampler_inputs(rows, seed)
        same(fn(logits.clone(), params, u, filtered), sample(logits.clone(), params, u, filtered))
    assert counters["stats"]["unique_graphs"] == 1
