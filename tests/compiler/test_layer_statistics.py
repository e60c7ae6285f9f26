import torch
from torch import nn

from squareq.compiler.layer_statistics import StatsCollector


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


def test_without_held_out_samples_a_share_of_rows_is_held_out_of_every_fit():
    torch.manual_seed(1)
    block = TwoLinears()
    x = torch.randn(400, 6)
    with StatsCollector("blk", block, max_rows=1000, holdout=0.25, seed=3) as col:
        for chunk in x.split(100):
            block(chunk)
    st = col.stats["blk.a"]
    held, fit = st.heldout_rows, st.rows
    assert 50 < held.shape[0] < 150 and st.gram_count == 400 - held.shape[0] == fit.shape[0]
    # every held-out row is one of the inputs, and the Gram matrix and moments are exactly the other rows'
    assert all(any(torch.equal(r, y) for y in x) for r in held[:5])
    assert torch.allclose(st.gram.float(), x.T @ x - held.T @ held, atol=1e-3)
    assert st.count == fit.shape[0] and torch.allclose(st.second_moment, fit.pow(2).mean(0))
    assert torch.equal(st.absmax, fit.abs().amax(0)) and torch.equal(st.judging_rows, held)


def test_a_layer_with_few_rows_still_holds_one_out():
    block = TwoLinears()
    with StatsCollector("blk", block, holdout=0.25, seed=0) as col:
        block(torch.randn(2, 6))
    st = col.stats["blk.a"]
    assert st.heldout_rows.shape[0] >= 1 and st.gram_count + st.heldout_rows.shape[0] == 2


def test_held_out_samples_are_whole_samples_and_padding_is_no_row():
    """Samples 1 and 3 held out: their real rows, and only theirs, are judged on; samples 0 and 2 are fitted; the
    padding the mask marks is in neither."""
    torch.manual_seed(2)
    block = TwoLinears()
    x = torch.randn(4, 5, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    with StatsCollector("blk", block, max_rows=100, seed=0, samples=4, heldout_samples=(1, 3), row_mask=mask) as col:
        block(x)
    st = col.stats["blk.a"]
    real = mask.bool()
    fit = torch.cat([x[0][real[0]], x[2][real[2]]])
    held = torch.cat([x[1][real[1]], x[3][real[3]]])
    assert torch.equal(st.rows, fit) and torch.equal(st.heldout_rows, held)
    assert st.gram_count == 8 and torch.allclose(st.gram.float(), fit.T @ fit, atol=1e-5)
    assert torch.equal(st.absmax, fit.abs().amax(0))


def test_an_input_without_the_batch_axis_first_holds_out_a_share_of_rows():
    block = TwoLinears()
    with StatsCollector("blk", block, max_rows=1000, seed=0, samples=4, heldout_samples=(0,)) as col:
        block(torch.randn(40, 6))  # 40 rows, not 4 samples
    st = col.stats["blk.a"]
    assert 0 < st.heldout_rows.shape[0] < 40 and st.rows.shape[0] + st.heldout_rows.shape[0] == 40


def col_hooks_removed(block):
    return all(not m._forward_pre_hooks for m in block.modules())
