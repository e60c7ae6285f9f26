import torch
from torch import nn

from squareq.compiler.calibration import StatsCollector


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_statistics_match_a_direct_computation():
    torch.manual_seed(0)
    block = TwoLinears()
    batches = [torch.randn(2, 5, 6) * torch.tensor([1, 1, 1, 1, 1, 30.0]) for _ in range(4)]
    with StatsCollector("blk", block, max_rows=1000, holdout=0.0) as col:
        for x in batches:
            block(x)
    x = torch.cat([b.reshape(-1, 6) for b in batches])
    st = col.stats["blk.a"]
    assert st.count == 40
    assert torch.equal(st.absmax, x.abs().amax(0))
    assert torch.allclose(st.second_moment, x.pow(2).mean(0))
    assert torch.allclose(st.hessian, (x.T @ x) / 40, rtol=1e-5)
    assert torch.equal(st.rows, x)  # under max_rows every row is kept, in order
    assert st.outlier_score() > 5  # the 30x channel stands out
    assert set(col.stats) == {"blk.a", "blk.b"} and col.stats["blk.b"].absmax.shape == (4,)


def test_row_sample_is_bounded_uniform_and_seeded():
    block = TwoLinears()
    x = torch.arange(600, dtype=torch.float32)[:, None].repeat(1, 6)

    def sample(seed):
        with StatsCollector("blk", block, max_rows=50, hessian=False, seed=seed, holdout=0.0) as col:
            for chunk in x.split(60):
                block(chunk)
        return col.stats["blk.a"].rows[:, 0]

    first, again, other = sample(1), sample(1), sample(2)
    assert first.shape == (50,) and torch.equal(first, again) and not torch.equal(first, other)
    assert first.min() < 100 and first.max() > 500  # drawn from the whole stream, not its start
    assert col_hooks_removed(block)


def test_measurement_rows_are_held_out_of_the_gram_matrix():
    torch.manual_seed(1)
    block = TwoLinears()
    x = torch.randn(400, 6)
    with StatsCollector("blk", block, max_rows=1000, holdout=0.25, seed=3) as col:
        for chunk in x.split(100):
            block(chunk)
    st = col.stats["blk.a"]
    held = st.rows
    assert 50 < held.shape[0] < 150 and st.gram_count == 400 - held.shape[0]
    # every held-out row is one of the inputs, and the Gram matrix is exactly the other rows'
    assert all(any(torch.equal(r, y) for y in x) for r in held[:5])
    assert torch.allclose(st.gram.float(), x.T @ x - held.T @ held, atol=1e-3)
    assert st.count == 400 and torch.allclose(st.second_moment, x.pow(2).mean(0))


def test_a_layer_with_few_rows_still_holds_one_out():
    block = TwoLinears()
    with StatsCollector("blk", block, holdout=0.25, seed=0) as col:
        block(torch.randn(2, 6))
    st = col.stats["blk.a"]
    assert st.rows.shape[0] >= 1 and st.gram_count + st.rows.shape[0] == 2


def col_hooks_removed(block):
    return all(not m._forward_pre_hooks for m in block.modules())
