"""Row argmax kernel vs torch.argmax: chunk edges, ties, strided logits, poisoned output."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import (
    CHUNK,
    RESOLVE_BLOCK,
    argmax_rows,
    argmax_rows_ref,
    resolve_placeholders,
    resolve_placeholders_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize(
    "num_rows,num_cols", [(1, 1), (3, 100), (5, CHUNK), (4, CHUNK + 1), (7, 3 * CHUNK - 5)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch(num_rows, num_cols, dtype, device):
    gen = torch.Generator().manual_seed(num_rows * 100_003 + num_cols)
    base = torch.randn(num_rows, num_cols + 37, generator=gen).to(dtype).to(device)
    x = base[:, 5 : 5 + num_cols]  # a strided view, as the LM head's padded logits
    out = torch.full((num_rows,), -7, dtype=torch.int64, device=device)

    assert argmax_rows(x, out=out) is out

    assert torch.equal(out.cpu(), argmax_rows_ref(x).cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index(dtype, device):
    num_cols = 2 * CHUNK + 300
    x = torch.zeros(4, num_cols, dtype=dtype, device=device)
    x[0, [CHUNK + 3, 9, 2 * CHUNK + 1]] = 2.0  # the winner is in the first chunk
    x[1, [2 * CHUNK + 5, CHUNK + 7]] = 1.5  # in the second
    x[2, :] = -1.0  # every column ties
    x[3, [CHUNK - 1, CHUNK]] = 3.0  # across a chunk edge
    assert argmax_rows(x).cpu().tolist() == [9, CHUNK + 7, 0, CHUNK - 1]
    assert torch.equal(argmax_rows(x).cpu(), argmax_rows_ref(x).cpu())


@pytest.mark.parametrize("fn", [argmax_rows, argmax_rows_ref], ids=["kernel", "ref"])
def test_argmax_writes_each_rows_token_into_token_buf(fn, device):
    """The decode step's feedback: token_buf[token_rows[r]] = argmax of row r; rows that
    sample nothing all target one spare row, and no other entry changes."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3 * CHUNK + 7, generator=gen).half().to(device)
    token_buf = torch.full((9,), -1, dtype=torch.int64, device=device)
    token_rows = torch.tensor([4, 8, 8, 0, 2, 8], device=device)  # 8: the spare row

    out = fn(x, token_buf=token_buf, token_rows=token_rows)

    want = argmax_rows_ref(x)
    assert torch.equal(out, want)
    expect = torch.full((9,), -1, dtype=torch.int64)
    expect[[4, 0, 2]] = want[[0, 3, 4]].cpu()
    assert torch.equal(token_buf[:8].cpu(), expect[:8])
    assert token_buf[8].item() in want[[1, 2, 5]].tolist()


@pytest.mark.parametrize("num_rows", [1, 5, RESOLVE_BLOCK + 3])
def test_resolve_placeholders_reads_token_buf(num_rows, device):
    gen = torch.Generator().manual_seed(num_rows)
    token_buf = torch.randint(0, 1000, (40,), generator=gen).to(device)
    ids = torch.randint(0, 1000, (num_rows,), generator=gen)
    ids[::2] = -1  # placeholders
    ids = ids.to(device)
    token_rows = torch.randint(0, 40, (num_rows,), generator=gen).to(device)

    got = resolve_placeholders(ids, token_buf, token_rows)

    assert torch.equal(got, resolve_placeholders_ref(ids, token_buf, token_rows))
    assert (got >= 0).all()


def test_argmax_rejects_bad_input(device):
    with pytest.raises(AssertionError, match="float logits"):
        argmax_rows(torch.zeros(2, 8, dtype=torch.int64, device=device))
    with pytest.raises(AssertionError, match="last dim contiguous"):
        argmax_rows(torch.zeros(8, 2, device=device).t())


def test_empty_batch(device):
    out = argmax_rows(torch.zeros(0, 50, device=device))
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.gpu
def test_argmax_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 50257, generator=gen).to(torch.float16).cuda()
    out = argmax_rows(x)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    x.copy_(torch.randn(64, 50257, generator=gen).to(torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, argmax_rows_ref(x))
