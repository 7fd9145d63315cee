"""Rollouts of a sequence-parallel group at ``1 / sp`` of the cost: each rank generates its share of the group's rows,
sampled with noise keyed by the row, so that a completion does not depend on the rank (or batch) that made it.

The pieces :class:`ds_usp.integration.trainers.rl.USPRolloutMixin` puts together:

* :func:`share`: the contiguous, balanced share of a call's rows a rank generates (whole prompt groups when they
  divide evenly, so that a ``rollout_func`` that generates a prompt's ``num_generations`` together gets them all);
  the shares concatenated in group-rank order (:func:`in_rank_order`) are the rows in the order one process has them;
* :class:`KeyedSampler`: HF's sampling warpers (temperature, top-k, top-p, min-p, ... in HF's order) and a draw by
  Gumbel-max with noise from a counter-based hash of ``(key of the row, decoding step, token)``: no random state, so
  the draw of row ``i`` is the same in any batch, on any rank, at any SP size;
* :class:`Rollout`: one rollout's keys (``(seed, round, the row's index in one process's batch, turn)``; a tool turn's
  row is found among the first turn's rows by its prefix), its generation calls and their checks.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor
from transformers import LogitsProcessor

_M64 = (1 << 64) - 1
_WARPERS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python integer (64-bit wrapping)."""
    x &= _M64
    x = ((x ^ (x >> 31)) * 0x7FB5D329728EA185) & _M64
    x = ((x ^ (x >> 27)) * 0x81DADEF4BC2DD44D) & _M64
    return x ^ (x >> 33)


def row_key(seed: int, round_: int, row: int, turn: int) -> int:
    """The noise key of one row of a rollout, as a signed 64-bit integer.

    Args:
        seed: the trainer's seed.
        round_: the rollout (``2 x`` TRL's step in training, odd numbers for evaluation rollouts).
        row: the row's index in the batch one process would generate (replica offset included).
        turn: 0 for the first generation, ``k`` for the ``k``-th tool turn.

    Returns:
        The key (the same on every rank for the same arguments).
    """
    x = _mix_int(seed)
    for part in (round_, row, turn):
        x = _mix_int(x ^ (part & _M64))
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _shr(x, 31)) * 0x7FB5D329728EA185
    x = (x ^ _shr(x, 27)) * -0x7E25210B43D22BB3  # 0x81DADEF4BC2DD44D as a signed int64
    return x ^ _shr(x, 33)


def sampling_warpers(config: Any) -> list:
    """HF's sampling warpers for ``config`` in the order ``GenerationMixin._get_logits_processor`` applies them.

    Args:
        config: a ``GenerationConfig`` with ``do_sample`` true.

    Returns:
        The warpers (public classes of ``transformers.generation.logits_process``).

    Raises:
        ValueError: a setting the keyed sampler does not reproduce (beam search, watermarking), named.
    """
    from transformers.generation import logits_process as lp

    unsupported = [f"{name}={getattr(config, name)!r}" for name, bad in (
        ("num_beams", (getattr(config, "num_beams", 1) or 1) > 1),
        ("watermarking_config", getattr(config, "watermarking_config", None) is not None)) if bad]
    if unsupported:
        raise ValueError(f"split rollouts sample each row with noise keyed by the row (so that a completion does not "
                         f"depend on the rank that generated it), which takes one sample per row: "
                         f"{', '.join(unsupported)} is not supported; generate without it, or give a rollout_func")
    c, warpers = config, []
    if c.temperature is not None and c.temperature != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(c.temperature))
    if getattr(c, "top_h", None) is not None:
        warpers.append(lp.TopHLogitsWarper(top_h=c.top_h))
    if c.top_k is not None and c.top_k != 0:
        warpers.append(lp.TopKLogitsWarper(top_k=c.top_k))
    if c.top_p is not None and c.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p=c.top_p))
    if c.min_p is not None:
        warpers.append(lp.MinPLogitsWarper(min_p=c.min_p))
    if c.typical_p is not None and c.typical_p < 1.0:
        warpers.append(lp.TypicalLogitsWarper(mass=c.typical_p))
    if c.epsilon_cutoff is not None and 0.0 < c.epsilon_cutoff < 1.0:
        warpers.append(lp.EpsilonLogitsWarper(epsilon=c.epsilon_cutoff))
    if c.eta_cutoff is not None and 0.0 < c.eta_cutoff < 1.0:
        warpers.append(lp.EtaLogitsWarper(epsilon=c.eta_cutoff))
    return warpers


def greedy(config: Any) -> Any:
    """A copy of ``config`` that picks the top token (the keyed sampler's one-hot scores) without sampling warpers."""
    out = copy.deepcopy(config)
    out.update(do_sample=False, **{name: None for name in _WARPERS if hasattr(out, name)})
    return out


class KeyedSampler(LogitsProcessor):
    """A logits processor (HF calls it after its own processors, with ``do_sample`` off) that samples row ``i`` from
    ``softmax(warped scores)`` with Gumbel noise keyed by ``keys[i]`` and the decoding step, and returns the draw as
    a one-hot score row.

    Args:
        keys: one key per row of the generate call (:func:`row_key`).
        warpers: :func:`sampling_warpers` of the sampling config.
    """

    def __init__(self, keys: Sequence[int], warpers: list) -> None:
        self.keys = torch.tensor(list(keys), dtype=torch.int64)
        self.warpers = warpers
        self.start: Optional[int] = None  # the prompt's (padded) length: the step counts from there

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """The one-hot scores of each row's draw at this step.

        Args:
            input_ids: ``(b, t)`` the tokens so far (left-padded prompt and the generated ones).
            scores: ``(b, V)`` the next token's scores after HF's processors.

        Returns:
            ``(b, V)``: 0 at the drawn token, ``-inf`` elsewhere.
        """
        if self.start is None:
            self.start = input_ids.shape[1]
        step = input_ids.shape[1] - self.start
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        b, v = scores.shape
        keys = self.keys.to(scores.device)
        base = _mix(keys ^ step)  # (b,)
        bits = _mix(base[:, None] ^ torch.arange(v, device=scores.device, dtype=torch.int64)[None])  # (b, V)
        u = (_shr(bits, 11).double() + 0.5) / float(1 << 53)  # uniform in (0, 1)
        choice = (scores.double() - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: a draw of softmax(scores)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(b, device=scores.device), choice] = 0.0
        return out


def share(n: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` generates: contiguous and balanced (sizes differ
    by at most one ``unit``), in units of ``unit`` rows when ``n`` divides into ``size`` shares of whole units.

    Args:
        n: the call's rows.
        size: the ranks sharing them.
        rank: this rank.
        unit: rows that should stay together (a prompt's ``num_generations``).

    Returns:
        ``(lo, hi)`` (``lo == hi``: an empty share).
    """
    unit = unit if unit > 1 and n % (unit * size) == 0 else 1
    units = n // unit
    return units * rank // size * unit, units * (rank + 1) // size * unit


def in_rank_order(parts: list) -> list:
    """The ranks' shares (in group-rank order, as :func:`ds_usp.comm.all_gather_objects` returns them) as one list:
    the rows in the order one process has them."""
    return [row for part in parts for row in part]


def digest(rows: Any) -> str:
    """A short fingerprint of a call's rows (the same on every rank that holds the same rows)."""
    return hashlib.sha1(pickle.dumps(rows, protocol=4)).hexdigest()[:16]


def merge_rollout_outputs(parts: list, sizes: list[int]) -> dict:
    """The outputs of the ranks' ``rollout_func`` calls on their shares as one output of the whole call: every
    per-prompt list concatenated in group-rank order; other values must be the same on every share.

    Args:
        parts: each rank's output dict (None for an empty share), in group-rank order.
        sizes: each rank's number of prompts.

    Returns:
        The merged output.

    Raises:
        ValueError: the shares returned different keys, a list that is not one value per prompt, or a non-list value
            that differs between them (named).
    """
    given = [(p, n) for p, n in zip(parts, sizes) if p is not None]
    keys = list(given[0][0]) if given else []
    problems = [f"the shares returned different keys ({sorted(p)} vs {sorted(keys)})"
                for p, _ in given if sorted(p) != sorted(keys)]
    merged = {}
    for key in keys if not problems else ():
        values = [p[key] for p, _ in given]
        if all(isinstance(v, list) for v in values):
            wrong = [(len(v), n) for v, (_, n) in zip(values, given) if len(v) != n]
            if wrong:
                problems.append(f"{key!r} holds {wrong[0][0]} values for a share of {wrong[0][1]} prompts")
            merged[key] = in_rank_order(values)
        elif all(v == values[0] for v in values):
            merged[key] = values[0]
        else:
            problems.append(f"{key!r} is not a list and differs between the shares")
    if problems:
        raise ValueError(f"split rollouts: each rank of a sequence-parallel group calls rollout_func on its share of "
                         f"the group's prompts, and the shares are joined key by key: {'; '.join(problems)}. Return "
                         f"one value per prompt for each key (a list), or the same non-list value whatever the prompts")
    return merged


@dataclass
class Rollout:
    """One rollout (one call of TRL's ``_generate``) of one rank: how its rows are keyed and shared.

    Attributes:
        seed: the trainer's seed.
        round: the rollout's number (:func:`row_key`).
        offset: the index of the rollout's first row in the batch one process would generate.
        size: the ranks that share the rows (1: this rank generates all of them).
        rank: this rank among them.
        unit: rows kept together in a first turn (``num_generations``).
        prompt_ids: the first turn's prompts (TRL's list).
        completion_ids: the first turn's completions (the list TRL's tool loop updates in place).
        calls: generation calls made so far.
        rows: the rows (positions in the call's list) this rank generates in the current call.
        in_user_code: a ``rollout_func`` runs on this rank's share (its own generation calls are not split again).
    """

    seed: int
    round: int
    offset: int
    size: int = 1
    rank: int = 0
    unit: int = 1
    prompt_ids: Optional[list] = None
    completion_ids: Optional[list] = None
    calls: int = 0
    rows: range = field(default_factory=lambda: range(0))
    in_user_code: bool = False

    def call(self, prompt_ids: list) -> tuple[bool, list[int]]:
        """A generation call of the rollout begins on ``prompt_ids`` (every row of the call): whether it is the first
        turn, and the keys of its rows (:meth:`keys`)."""
        first = self.prompt_ids is None
        keys = self.keys(prompt_ids)
        self.calls += 1
        if first:
            self.prompt_ids = prompt_ids
        return first, keys

    def generating(self, lo: int, hi: int) -> None:
        """This rank generates the rows ``[lo, hi)`` of the current call."""
        self.rows = range(lo, hi)

    def first_turn_done(self, prompt_ids: Optional[list], completion_ids: Optional[list]) -> None:
        """The first turn's rows and completions (a ``rollout_func``'s, or the first generation call's): tool turns
        that follow are keyed by them."""
        self.prompt_ids, self.completion_ids = prompt_ids, completion_ids
        self.calls = max(self.calls, 1)

    @contextlib.contextmanager
    def in_user_share(self, lo: int, hi: int) -> Iterator[None]:
        """A ``rollout_func`` runs on the rows ``[lo, hi)`` (its own generation calls are not split again)."""
        self.rows, self.in_user_code = range(lo, hi), True
        try:
            yield
        finally:
            self.in_user_code = False

    def share(self, n: int, first: bool) -> tuple[int, int]:
        """This rank's rows ``[lo, hi)`` of a call of ``n`` rows (prompt groups kept together in a first turn)."""
        return share(n, self.size, self.rank, self.unit if first else 1)

    def keys(self, rows: list) -> list[int]:
        """The keys of a generation call's rows: a first turn's by their index; a tool turn's (rows that begin with
        a first-turn row's prompt and completion so far, in the order of the first turn) by that row's index and the
        turn; a row that begins with none of them by its content and place."""
        turn = self.calls
        if self.prompt_ids is None:  # the first turn: these rows are the rollout's
            return [row_key(self.seed, self.round, self.offset + i, 0) for i in range(len(rows))]
        keys, last = [], -1
        for j, row in enumerate(rows):
            found = next((i for i in range(last + 1, len(self.prompt_ids)) if self._begins(row, i)), None)
            if found is None:
                keys.append(row_key(self.seed, self.round, int(digest(row), 16) ^ j, turn))
                continue
            last = found
            keys.append(row_key(self.seed, self.round, self.offset + found, turn))
        return keys

    def _begins(self, row: list, i: int) -> bool:
        prefix = list(self.prompt_ids[i]) + list(self.completion_ids[i] if self.completion_ids is not None else [])
        return len(row) >= len(prefix) and list(row[:len(prefix)]) == prefix
