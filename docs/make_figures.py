"""Draw every figure of docs/ into docs/img/ (deterministic, no network; needs matplotlib).

    python docs/make_figures.py                      # all of them
    python docs/make_figures.py wire_loss.png        # some of them

The figures of docs/how_usp_works.md (``usp_2x2.png``, ``zigzag_balance.png``, ``linear_vs_attention.png``) come
from ds-usp's own code: which positions a rank holds from ``ds_usp.sharding``, which (query, key) pairs the ring
computes at each step from ``ds_usp.attention.masks``, and the bytes a layer sends from ``ds_usp.cost``, so the
pictures change when the code does. The figures of docs/benchmarks.md are drawn from result files in
``benchmarks/results/`` by the benchmark's own plot function: ``long_seq_memory.png`` from ``long_seq.json``
(``benchmarks/long_seq.py``), ``wire_loss.png`` from ``wire_loss.json`` (``benchmarks/wire_loss.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package
RESULTS = ROOT / "benchmarks" / "results"

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from ds_usp.attention.masks import MaskSpec, RowMask, block_parts  # noqa: E402
from ds_usp.cost import backward_bytes, forward_bytes, linear_bytes  # noqa: E402
from ds_usp.sharding import padded_length, piece_runs, ring_piece_positions, shard_positions  # noqa: E402
from ds_usp.topology import group_ranks  # noqa: E402

OUT = ROOT / "docs" / "img"
CHUNK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
EMPTY = "#EEEEEE"
PNG_META = {"Software": None}  # no matplotlib version in the file: same bytes on every run


def _holding_image(positions: list[int], heads: range, seq: int, num_heads: int, chunk: int) -> np.ndarray:
    """(heads, seq) image: the zigzag chunk index + 1 where this rank holds (head, position), else 0."""
    img = np.zeros((num_heads, seq))
    for h in heads:
        for p in positions:
            img[h, p] = p // chunk + 1
    return img


def figure_usp_2x2(path: Path) -> None:
    """Which rank holds which tokens and heads before and after the Ulysses all-to-all, 2 x 2 zigzag."""
    u, r, seq, heads = 2, 2, 16, 4
    layout = "zigzag"
    plan = group_ranks(u, r, u * r)
    padded = padded_length(seq, u, r, layout)
    chunk = padded // (2 * r)
    cmap = ListedColormap([EMPTY] + CHUNK_COLORS[: 2 * r])

    fig = plt.figure(figsize=(13, 6.2))
    panels = fig.subfigures(1, 2, wspace=0.06)
    titles = ["1. after shard_sequence: a slice of the sequence, all heads",
              "2. after the Ulysses all-to-all: a ring piece, H/U heads"]
    axes_by_panel = []
    for pi, (sub, title) in enumerate(zip(panels, titles)):
        sub.suptitle(title, fontsize=11.5)
        axs = sub.subplots(r, u, gridspec_kw={"hspace": 0.75, "wspace": 0.6 if pi == 0 else 0.35})
        sub.subplots_adjust(bottom=0.17, top=0.85)
        axes_by_panel.append(axs)
        for ri in range(r):
            for ui in range(u):
                rank = ri * u + ui  # dp_index * N + ring_index * U + ulysses_index, one replica
                if pi == 0:
                    pos = shard_positions(padded, u, r, rank, layout).tolist()
                    hs = range(heads)
                else:
                    pos = ring_piece_positions(padded, r, ri, layout).tolist()
                    hs = range(ui * heads // u, (ui + 1) * heads // u)
                ax = axs[ri, ui]
                ax.imshow(_holding_image(pos, hs, padded, heads, chunk), cmap=cmap, vmin=0, vmax=2 * r,
                          aspect="auto", interpolation="nearest")
                ax.set_title(f"rank {rank}  (ring {ri}, ulysses {ui})", fontsize=10)
                ax.set_xticks(range(0, padded, chunk))
                ax.set_xticks(np.arange(-0.5, padded, 1), minor=True)
                ax.set_yticks(range(heads))
                ax.set_yticks(np.arange(-0.5, heads, 1), minor=True)
                ax.grid(which="minor", color="white", linewidth=0.6)
                ax.tick_params(which="minor", length=0, labelsize=8)
                ax.tick_params(labelsize=8)
                ax.set_xlabel("token position", fontsize=8)
                if ui == 0:
                    ax.set_ylabel(f"node {ri}\nhead", fontsize=9)
    # what connects the rank boxes: the all-to-all inside a row (a node), the ring down a column
    before, after = axes_by_panel
    for ri in range(r):
        left, right = before[ri, 0].get_position(), before[ri, 1].get_position()
        group = list(plan.member_of("ulysses", ri * u))
        panels[0].text((left.x1 + right.x0) / 2, (left.y0 + left.y1) / 2, f"\u27f7\nall-to-all\n{group}",
                       ha="center", va="center", fontsize=9, color="#333333")
    for ui in range(u):
        top, bottom = after[0, ui].get_position(), after[r - 1, ui].get_position()
        ring = list(plan.member_of("ring", ui))
        panels[1].text((top.x0 + top.x1) / 2, (top.y0 + bottom.y1) / 2 - 0.005,
                       f"\u2195 ring {ring}: K/V blocks to the next rank", ha="center", va="center",
                       fontsize=9, color="#8B0000", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    handles = [plt.Rectangle((0, 0), 1, 1, color=CHUNK_COLORS[i]) for i in range(2 * r)]
    labels = [f"zigzag chunk {i} (tokens {i * chunk}-{(i + 1) * chunk - 1})" for i in range(2 * r)]
    fig.legend(handles, labels, loc="lower center", ncol=2 * r, fontsize=9, frameon=False,
               title=f"U={u} x R={r}, {layout} layout, {seq} tokens, {heads} heads; "
                     f"rank = ring x U + ulysses (one replica)", title_fontsize=9)
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)


def _block_work(mask: MaskSpec, pieces: tuple, me: int, src: int) -> int:
    """(query, key) pairs the kernel computes when ring rank ``me`` holds ``src``'s K/V block."""
    total = 0
    for part in block_parts(mask, RowMask((0,)), pieces[me], pieces[src]):
        nq, nk = part.q.stop - part.q.start, part.k.stop - part.k.start
        i = np.arange(nq)
        lo = np.zeros(nq, dtype=int) if part.lo is None else np.maximum(0, i + part.lo)
        hi = np.full(nq, nk - 1) if part.hi is None else np.minimum(nk - 1, i + part.hi)
        total += int(np.maximum(0, hi - lo + 1).sum())
    return total


def figure_zigzag_balance(path: Path) -> None:
    """Causal work per ring rank and per ring step, contiguous vs zigzag."""
    r, seq_small, seq = 4, 32, 4096
    layouts = ["contiguous", "zigzag"]
    fig, axs = plt.subplots(2, 2, figsize=(11, 9.5))
    cmap = ListedColormap(["white"] + CHUNK_COLORS[:r])
    for ax, layout in zip(axs[0], layouts):
        padded = padded_length(seq_small, 1, r, layout)
        owner = np.zeros(padded, dtype=int)
        for ri in range(r):
            owner[ring_piece_positions(padded, r, ri, layout).numpy()] = ri + 1
        img = np.where(np.tril(np.ones((padded, padded), dtype=bool)), owner[:, None], 0)
        ax.imshow(img, cmap=cmap, vmin=0, vmax=r, interpolation="nearest")
        ax.set_title(f"{layout} layout: causal attention,\ncoloured by the ring rank that "
                     f"owns the query (R={r}, {padded} tokens)", fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [plt.Rectangle((0, 0), 1, 1, color=CHUNK_COLORS[i]) for i in range(r)]
    axs[0, 1].legend(handles, [f"ring rank {i}" for i in range(r)], loc="upper right", fontsize=9)

    padded = padded_length(seq, 1, r, "zigzag")
    total = padded * (padded + 1) // 2
    mask = MaskSpec(causal=True, seq_len=padded)
    width = 0.38
    per_rank, per_step = {}, {}
    for layout in layouts:
        work = np.zeros((r, r))  # (step, ring rank)
        pieces = tuple(piece_runs(padded, r, i, layout) for i in range(r))
        for me in range(r):
            for step in range(r):
                work[step, me] = _block_work(mask, pieces, me, (me - step) % r)
        assert work.sum() == total  # every causal pair exactly once
        per_rank[layout] = work.sum(axis=0) / total
        per_step[layout] = work.max(axis=1) / total
    x = np.arange(r)
    for i, layout in enumerate(layouts):
        axs[1, 0].bar(x + (i - 0.5) * width, per_rank[layout], width, label=layout,
                      color=["#999999", "#4C72B0"][i])
    axs[1, 0].axhline(1 / r, color="black", linestyle=":", linewidth=1, label=f"perfect balance (1/{r})")
    axs[1, 0].set_xticks(x, [f"ring rank {i}" for i in x])
    axs[1, 0].set_ylabel("share of all causal (q, k) pairs")
    axs[1, 0].set_title(f"work per ring rank (S={seq}, R={r})", fontsize=10)
    axs[1, 0].set_ylim(0, 1.25 * max(v.max() for v in per_rank.values()))
    axs[1, 0].legend(fontsize=9, loc="upper left")
    for i, layout in enumerate(layouts):
        axs[1, 1].bar(x + (i - 0.5) * width, per_step[layout], width,
                      label=f"{layout}: ring time {per_step[layout].sum():.2f}", color=["#999999", "#4C72B0"][i])
    axs[1, 1].set_xticks(x, [f"step {i}" for i in x])
    axs[1, 1].set_ylabel("slowest rank's pairs / all pairs")
    axs[1, 1].set_title("per ring step, the slowest rank (every rank waits for it)", fontsize=10)
    axs[1, 1].set_ylim(0, 1.4 * max(v.max() for v in per_step.values()))
    axs[1, 1].legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)


def figure_linear_vs_attention(path: Path) -> None:
    """Bytes one rank sends per layer (forward + backward) of a Qwen3-Next-like model, softmax vs linear attention."""
    u, r, e = 4, 4, 2  # 4 Ulysses x 4 ring, bf16
    seqs = [2 ** k for k in range(15, 21)]  # 32K ... 1M tokens
    attn = [(forward_bytes(1, s, 16, 2, 256, u, r, e), backward_bytes(1, s, 16, 2, 256, u, r, e)) for s in seqs]
    lin = [linear_bytes(1, s, 16, 32, 128, 128, 4, u, r, e, 2) for s in seqs]
    fig, axs = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, rows, title in ((axs[0], attn, "softmax attention layer (16 q / 2 kv heads, d=256)"),
                            (axs[1], lin, "Gated DeltaNet layer (16 k / 32 v heads, dk=dv=128)")):
        per_token = 1024.0 * np.array(seqs)  # KiB per token of the sequence
        a2a = np.array([f.all_to_all + b.all_to_all for f, b in rows]) / per_token
        ring = np.array([f.ring + f.other + b.ring + b.other for f, b in rows]) / per_token
        x = np.arange(len(seqs))
        ax.bar(x, a2a, color="#4C72B0", label="Ulysses all-to-all (heads)")
        ax.bar(x, ring, bottom=a2a, color="#DD8452", label="ring (K/V blocks / halos and states)")
        ax.set_xticks(x, [f"{s // 1024}K" for s in seqs])
        ax.set_xlabel("sequence length")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
    axs[0].set_ylabel("KiB sent per rank per token of the sequence\n(forward + backward)")
    fig.suptitle(f"what one rank sends per layer, U={u} x R={r}, bf16: linear attention's ring carries "
                 f"a state per segment, not the sequence", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_META)
    plt.close(fig)


def _benchmark(name: str):
    """A script of ``benchmarks/`` as a module (its folder first on ``sys.path``, as when it runs)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def figure_long_seq_memory(path: Path) -> None:
    """Per-rank peak of a training step against S, one line per system, from ``benchmarks/results/long_seq.json``."""
    data = json.loads((RESULTS / "long_seq.json").read_text())
    rows = [{k: None if v == "-" else v for k, v in r.items()} for r in data["rows"]]
    _benchmark("long_seq").plot(rows, str(path), argparse.Namespace(**data["args"]))


def figure_wire_loss(path: Path) -> None:
    """The demo's loss curves per wire and their differences, from ``benchmarks/results/wire_loss.json``."""
    data = json.loads((RESULTS / "wire_loss.json").read_text())
    runs = {r["run"]: [{"step": i + 1, "loss": x} for i, x in enumerate(r["losses"])] for r in data["rows"]}
    _benchmark("wire_loss").plot(runs, path)


FIGURES = {"usp_2x2.png": figure_usp_2x2, "zigzag_balance.png": figure_zigzag_balance,
           "linear_vs_attention.png": figure_linear_vs_attention, "long_seq_memory.png": figure_long_seq_memory,
           "wire_loss.png": figure_wire_loss}


def main() -> None:
    names = sys.argv[1:] or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise SystemExit(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        FIGURES[name](OUT / name)
        print(OUT / name)


if __name__ == "__main__":
    main()
