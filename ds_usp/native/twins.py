"""The PyTorch twins of the native op: the same six functions and signatures, in plain PyTorch, with the same
numbers (bitwise, except the merge, whose exp/log1p agree within a few ulp, and the replica sums of
``unpack_head_to_seq``, within fp32 rounding).

:class:`TorchOps` is what :func:`ds_usp.native.resolve_native_op` hands out when the native op is off or
cannot be built, and the oracle the native op is tested against. :class:`ds_usp.native.NativeOps`
subclasses it and replaces each method with one native kernel pass, so callers never branch on
which one they hold. Shapes use the legend of docs/architecture.md (``U`` the Ulysses degree,
``Hp`` the head columns of one all-to-all chunk).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


class TorchOps:
    """The LSE merge, fp32 accumulation and Ulysses packing in PyTorch (``source`` is ``"pytorch"``)."""

    source = "pytorch"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source})"

    def merge_block_(self, out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        """Fold one block's partial attention into the running result, in place, exactly.

        ``out = (out * e^lse + block_out * e^block_lse) / e^new_lse`` with ``new_lse = logaddexp``;
        rows whose both LSEs are ``-inf`` (no key seen yet) stay zero, never NaN.

        Args:
            out: running output, fp32 ``(b, s, h, d)`` (may be a strided view); updated in place.
            lse: running LSE, fp32 ``(b, h, s)`` (may be a strided view); updated in place.
            block_out: the block's output ``(b, s, h, d)``, fp32/bf16/fp16.
            block_lse: the block's LSE, fp32 ``(b, h, s)``.
        """
        new_lse = torch.logaddexp(lse, block_lse)
        ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
        # (b, h, s) -> (b, s, h, 1) to scale (b, s, h, d) rows
        w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
        w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
        out.mul_(w_old).add_(block_out.float() * w_new)
        lse.copy_(new_lse)

    def accumulate_(self, acc: Tensor, x: Tensor) -> None:
        """``acc += x`` with ``x`` converted to fp32, in place.

        Args:
            acc: fp32 ``(b, s, h, d)`` accumulator (may be a strided view).
            x: ``(b, s, h, d)`` of any supported float dtype.
        """
        acc += x

    def pack_seq_to_head(self, xs: Sequence[Tensor], reps: Sequence[int], world: int) -> Tensor:
        """Sequence shards into the all-to-all send buffer, kv heads replicated where needed.

        Args:
            xs: tensors ``(b, s, h_i, d)`` of one dtype (e.g. q, k, v).
            reps: per tensor, how often each head is repeated (``U // hkv`` for kv heads that the
                Ulysses degree does not divide, else 1).
            world: the Ulysses degree U.

        Returns:
            The contiguous send buffer ``(U, b, s, Hp, d)``, ``Hp = sum_i h_i * reps_i / U``; chunk ``u``
            holds the heads of every tensor destined for Ulysses rank ``u``, tensor after tensor.
        """
        b, s, _, d = xs[0].shape
        parts = []
        for x, rep in zip(xs, reps):
            if rep > 1:
                x = x.repeat_interleave(rep, dim=2)  # (b, s, h, d) -> (b, s, h*rep, d)
            parts.append(x.reshape(b, s, world, x.shape[2] // world, d))  # -> (b, s, U, h'/U, d)
        both = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)  # (b, s, U, Hp, d)
        return both.permute(2, 0, 1, 3, 4).contiguous()  # -> (U, b, s, Hp, d)

    def unpack_seq_to_head(self, recv: Tensor) -> Tensor:
        """The received buffer as head shards over the Ulysses group's whole sequence.

        Args:
            recv: ``(U, b, s, Hp, d)`` contiguous, chunk ``u`` from Ulysses rank ``u``.

        Returns:
            ``(b, U*s, Hp, d)``: a view of ``recv`` when ``b == 1``, else a contiguous copy. Split
            the head columns with ``.split(heads, dim=2)``.
        """
        u, b, s, hp, d = recv.shape
        # (U, b, s, Hp, d) -> (b, U, s, Hp, d) -> (b, U*s, Hp, d)
        return recv.permute(1, 0, 2, 3, 4).reshape(b, u * s, hp, d)

    def pack_head_to_seq(self, xs: Sequence[Tensor], world: int) -> Tensor:
        """Head shards into the all-to-all send buffer (the way back).

        Args:
            xs: tensors ``(b, U*s, h_i, d)`` of one dtype.
            world: the Ulysses degree U.

        Returns:
            The contiguous send buffer ``(U, b, s, sum_i h_i, d)`` (a view of ``xs[0]`` when it is the
            only tensor, contiguous and ``b == 1``).
        """
        x = xs[0] if len(xs) == 1 else torch.cat(list(xs), dim=2)  # (b, U*s, H, d)
        b, big_s, h, d = x.shape
        # (b, U*s, H, d) -> (b, U, s, H, d) -> (U, b, s, H, d)
        return x.reshape(b, world, big_s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()

    def unpack_head_to_seq(self, recv: Tensor, heads: Sequence[int], reps: Sequence[int]) -> list[Tensor]:
        """The received buffer as sequence shards, replicated heads summed (fp32 sum, one rounding).

        Args:
            recv: ``(U, b, s, Hp, d)`` contiguous.
            heads: head columns per result in one chunk, summing to ``Hp``.
            reps: replication factor per result (as given to :meth:`pack_seq_to_head`).

        Returns:
            ``[(b, s, U * heads_i / reps_i, d)]``, contiguous.
        """
        u, b, s, _, d = recv.shape
        outs = []
        for part, rep in zip(recv.split(list(heads), dim=3), reps):
            # (U, b, s, h_i, d) -> (b, s, U, h_i, d) -> (b, s, U*h_i, d)
            x = part.permute(1, 2, 0, 3, 4).reshape(b, s, u * part.shape[3], d)
            if rep > 1:  # (b, s, U*h_i, d) -> (b, s, U*h_i/rep, rep, d) -> sum the replicas (fp32 at least)
                x = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(b, s, -1, rep, d).sum(3).to(recv.dtype)
            outs.append(x.contiguous())
        return outs
