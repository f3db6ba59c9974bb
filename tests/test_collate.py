"""Collation of variable-size samples: per-rank padding and packing with cu_seqlens, checked
against attention over each sample alone."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetlb.data.collate import block_diagonal_mask, pad_collate, packed_collate, to_nested


def samples(lengths, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, dim, generator=g), torch.tensor(i)) for i, n in enumerate(lengths)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_pad_and_pack_hold_every_sample(lengths):
    batch = samples(lengths)
    p = pad_collate(batch)
    assert p.data.shape == (len(lengths), max(lengths), 4)  # this batch's own longest
    assert p.lengths.tolist() == lengths and p.rest[0].tolist() == list(range(len(lengths)))
    q = packed_collate(batch)
    assert q.data.shape == (sum(lengths), 4) and q.max_seqlen == max(lengths)
    assert q.cu_seqlens.dtype == torch.int32 and q.lengths.tolist() == lengths
    for i, (x, _) in enumerate(batch):
        assert torch.equal(p.data[i, :lengths[i]], x) and not p.data[i, lengths[i]:].any()
        assert torch.equal(q.data[q.cu_seqlens[i]:q.cu_seqlens[i + 1]], x)
        assert p.mask()[i].sum() == lengths[i]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.booleans())
def test_packed_attention_equals_attention_per_sample(lengths, causal):
    batch = samples(lengths, dim=8, seed=len(lengths))
    q = packed_collate(batch)
    x = q.data[None, None]  # [1, 1, N, 8]
    out = torch.nn.functional.scaled_dot_product_attention(
        x, x, x, attn_mask=block_diagonal_mask(q.cu_seqlens, causal=causal))[0, 0]
    for i, (s, _) in enumerate(batch):
        alone = torch.nn.functional.scaled_dot_product_attention(s[None], s[None], s[None],
                                                                 is_causal=causal)[0]
        torch.testing.assert_close(out[q.cu_seqlens[i]:q.cu_seqlens[i + 1]], alone)
    nested = to_nested(q)
    for i, (s, _) in enumerate(batch):
        assert torch.equal(nested[i], s)


def test_plain_tensors_empty_batches_and_errors():
    p = pad_collate([torch.ones(2, 3), torch.ones(5, 3)])
    assert p.data.shape == (2, 5, 3) and p.rest is None
    assert pad_collate([]).data.numel() == 0 and packed_collate([]).cu_seqlens.tolist() == [0]
    with pytest.raises(ValueError, match="only the first dimension may vary"):
        packed_collate([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(ValueError, match="sample 1: expected a tensor"):
        pad_collate([torch.ones(2), 5])


class PackedMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, packed):
        per_token = self.lin(packed.data)[:, 0]
        return torch.segment_reduce(per_token, "mean", lengths=packed.lengths)


def test_collate_fn_through_the_balanced_loader():
    import hetlb
    lengths = [3, 9, 1, 7, 2, 8, 4, 6]
    ds = [(torch.full((n, 2), float(i)), torch.tensor(i)) for i, n in enumerate(lengths)]
    model = PackedMean()
    # a packed batch's first dimension counts tokens: tell the Balancer how to count samples
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform(),
                         batch_dim=lambda args, kwargs: args[0].cu_seqlens.numel() - 1)
    loader = bal.loader(ds, collate_fn=packed_collate, shuffle=False)
    got = []
    for b in loader:
        got.append(b)
        model(b).sum().backward()
    assert [b.rest[0].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.lengths.tolist() for b in got] == [lengths[:4], lengths[4:]]
    assert bal.steps == 2


def test_a_rank_given_no_samples_gets_an_empty_batch_of_the_right_kind():
    from hetlb.data.collate import EmptySafeCollate
    ds = [(torch.arange(n + 1), torch.tensor(n)) for n in (3, 5)]
    for fn in (packed_collate, pad_collate):
        e = EmptySafeCollate(ds, fn)([])
        assert type(e) is type(fn(ds[:1]))
        assert e.data.dtype == torch.int64 and e.data.shape[0] == 0
        assert e.lengths.numel() == 0 and e.rest[0].shape == (0,)
    assert EmptySafeCollate(ds, packed_collate)([]).cu_seqlens.tolist() == [0]
