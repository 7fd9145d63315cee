"""``torch.compile`` of a model with USP attention gives the eager gradients, on a 4-rank gloo world.

The attention's forward and backward are custom ops with a registered derivative
(ds_usp/attention/usp.py), so the compiled graph has no break at the attention (``fullgraph=True``
would raise otherwise) and the collectives inside run as in eager mode. The failure this guards
against is silent: an autograd function that fills ``empty_like`` buffers through collectives,
traced by the compiler, yields zero gradients upstream while the forward stays right. So the test
checks that the upstream gradients are far from zero and equal eager's (fp32, rtol 1e-5).
Both ``aot_eager`` (the tracer and the autograd partitioner) and ``inductor`` (code generation) run.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

SEQ, HIDDEN, HEADS, KV_HEADS = 61, 32, 4, 2


class TinyBlock(nn.Module):
    """Projections -> USP attention -> output projection, like a transformer layer without the MLP."""

    def __init__(self, topo, layout: str) -> None:
        super().__init__()
        self.topo, self.layout = topo, layout
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.kv = nn.Linear(HIDDEN, 2 * HIDDEN // HEADS * KV_HEADS)
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ds_usp

        b, s, _ = x.shape
        d = HIDDEN // HEADS
        q = self.q(x).view(b, s, HEADS, d)  # (b, s, hidden) -> (b, s, h, d)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, d).unbind(2)  # -> 2 x (b, s, h_kv, d)
        out = ds_usp.usp_attention(q, k, v, self.topo, causal=True, layout=self.layout, seq_len=SEQ)
        return self.o(out.reshape(b, s, HIDDEN))


def compiled_matches_eager(u: int, r: int, layout: str, backend: str) -> float:
    """On every rank: eager and compiled forward+backward of the same block and shard; returns the grad norm."""
    import ds_usp

    topo = ds_usp.USPTopology.build(u, r)
    torch.manual_seed(0)
    block = TinyBlock(topo, layout)
    x_full = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    x = ds_usp.shard_sequence(x_full, topo, layout=layout)

    def grads(fn) -> list[torch.Tensor]:
        block.zero_grad()
        xi = x.clone().requires_grad_()
        fn(xi).square().sum().backward()
        return [xi.grad] + [p.grad.clone() for p in block.parameters()]

    eager = grads(block)
    torch._dynamo.reset()
    compiled = grads(torch.compile(block, backend=backend, fullgraph=True))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    norm = float(eager[0].norm())  # dx flows back through the attention's custom op
    assert norm > 1e-3 and float(eager[1].norm()) > 1e-3  # and q's projection gets a real gradient
    return norm


@pytest.mark.parametrize("u,r,layout,backend", [(2, 2, "zigzag", "aot_eager"), (4, 1, "contiguous", "aot_eager"),
                                                (1, 4, "zigzag", "aot_eager"), (2, 2, "zigzag", "inductor")])
def test_compile_gives_eager_gradients(world4, u, r, layout, backend):
    norms = world4.run(compiled_matches_eager, u, r, layout, backend)
    assert all(n > 1e-3 for n in norms)


def gather_under_compile() -> bool:
    """gather_sequence (an all-gather custom op) differentiates under compile as in eager."""
    import ds_usp

    topo = ds_usp.USPTopology.build(2, 2)
    x = torch.randn(1, 8, 3, generator=torch.Generator().manual_seed(topo.rank), requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        full = ds_usp.gather_sequence(t * 2, topo, dim=1, layout="contiguous")
        return (full * torch.arange(full.shape[1]).view(1, -1, 1)).sum()

    f(x).backward()
    eager = x.grad.clone()
    x.grad = None
    torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager)
    assert eager.abs().sum() > 0
    return True


def test_gather_sequence_under_compile(world4):
    assert all(world4.run(gather_under_compile))
