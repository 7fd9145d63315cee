"""A GRPO ``rollout_func`` written to TRL's contract, under sequence parallelism (issue 64): TRL gives it "the list of
prompts allocated to the current process and the trainer", and functions place their rows in the whole batch at
``trainer.accelerator.process_index * len(prompts)``, gather the prompts over the processes and take their slice
(TRL's server mode), or seed per process. ds-usp calls such a function once per SP group, on the group's first rank,
with the replica's whole prompts (``process_index`` the replica's index), and shares its output with the group: the
call one process of a data-parallel run of the replicas makes. Before, each rank of a group called it on its share of
the prompts with the replica's ``process_index``: every rank computed the group's first rows (within a prompt group
the completions repeated, the rewards' std fell, the training differed from one process), silently.

Each function trains 3 GRPO steps on 4 gloo ranks at (U, R) = 2x2 ZeRO-2, 1x4 ZeRO-3 (Qwen3) and 2x1 ZeRO-2 with 2
replicas, against TRL's trainer in one process on the same global batch (every completion, every logged metric, every
final parameter), the function called there as the replicas' processes would call it. The functions' calls are
counted: one per rollout, on each group's first rank, with the replica's prompts. A function that opts in to split
calls (``takes_rollout_rows``) is tests/test_rl.py's.
"""
from __future__ import annotations

import pytest
import torch
from accelerate.utils import broadcast_object_list, gather_object

from test_rl import VOCAB, _common, _ds_config, _one_process, _prompts, _reward_even, _reward_long, _same, \
    _summary, _tokenizer

pytest.importorskip("trl")
WORLD_TIMEOUT = 120  # seconds a case may take (each takes a few): a rank waiting forever fails the case
CALLS: list = []  # on each rank: (process_index, number of prompts) of each rollout_func call it made
FREE: list = []  # on each rank: what accelerate's free tensor operations gave in each call (free_server_rollout)
COMPLETIONS: list = []  # on each rank: the completions of each rollout, as the reward functions see them

# (name, model, ZeRO stage, U, R, layout): 1 replica at 2x2 and 1x4; 2 replicas of an SP group of 2 at 2x1
LAYOUTS = {"zero2-2x2": ("llama", 2, 2, 2, "zigzag"), "zero3-1x4": ("qwen3", 3, 1, 4, "contiguous"),
           "zero2-2x1-2-replicas": ("llama", 2, 2, 1, "zigzag")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from test_rl import _config

    dirs = {}
    for family in ("llama", "qwen3"):
        path = str(tmp_path_factory.mktemp(family))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).save_pretrained(path)
        _tokenizer().save_pretrained(path)
        dirs[family] = path
    return dirs


# ---- rollout functions to TRL's contract --------------------------------------------------------------------------

def _completion(ids: list, g: torch.Generator) -> list:
    """A completion of 3..15 tokens drawn with ``g``; two thirds end with EOS (1), the others are truncated."""
    n = 3 + int(torch.randint(0, 13, (1,), generator=g))
    completion = torch.randint(4, VOCAB, (n,), generator=g).tolist()
    if int(torch.randint(0, 3, (1,), generator=g)):
        completion[-1] = 1
    return completion


def _output(trainer, prompts: list, completion_ids: list) -> dict:
    prompt_ids = [trainer.processing_class(prompt)["input_ids"] for prompt in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


def offset_rollout(prompts: list, trainer) -> dict:
    """Seeds each row by its place in the whole batch, ``process_index * len(prompts) + i``."""
    CALLS.append((trainer.accelerator.process_index, len(prompts)))
    first = trainer.accelerator.process_index * len(prompts)
    return _output(trainer, prompts, [_completion([], torch.Generator().manual_seed(1000 + first + i))
                                      for i in range(len(prompts))])


def _server(all_prompts: list) -> list:
    """A stand-in generation server: the completions of a whole batch (row ``j`` from its prompt and ``j``)."""
    return [_completion([], torch.Generator().manual_seed(sum(map(ord, p)) * 7 + j)) for j, p in enumerate(all_prompts)]


def server_rollout(prompts: list, trainer) -> dict:
    """TRL's server idiom: the prompts gathered over the processes, one request, this process's slice."""
    CALLS.append((trainer.accelerator.process_index, len(prompts)))
    everything = trainer.accelerator.gather_for_metrics(prompts, use_gather_object=True)
    first = trainer.accelerator.process_index * len(prompts)
    return _output(trainer, prompts, _server(everything)[first:first + len(prompts)])


def seeded_rollout(prompts: list, trainer) -> dict:
    """Draws its rows one after another from a generator seeded per process."""
    CALLS.append((trainer.accelerator.process_index, len(prompts)))
    g = torch.Generator().manual_seed(int(trainer.args.seed) + 17 * trainer.accelerator.process_index)
    return _output(trainer, prompts, [_completion([], g) for _ in prompts])


def free_server_rollout(prompts: list, trainer) -> dict:
    """TRL's server mode as its own code writes it, with accelerate's free functions: the prompts gathered with
    ``gather_object``, one request on the main process, its answer sent to every process with
    ``broadcast_object_list``, this process's slice (the same completions as :func:`server_rollout`)."""
    CALLS.append((trainer.accelerator.process_index, len(prompts)))
    everything = gather_object(list(prompts))
    answer = [_server(everything) if trainer.accelerator.is_main_process else None]
    broadcast_object_list(answer, from_process=0)
    first = trainer.accelerator.process_index * len(prompts)
    FREE.append(_free_tensor_operations(trainer.accelerator.process_index))
    return _output(trainer, prompts, answer[0][first:first + len(prompts)])


def _free_tensor_operations(index: int) -> dict:
    """accelerate's other free operations on small tensors, as process ``index`` (and the gather accelerate runs on
    NCCL instead of gloo's, through the operations module's torch)."""
    import accelerate.utils.operations as operations
    from accelerate.utils import broadcast, gather, pad_across_processes, reduce

    mine = torch.tensor([float(index + 1)])
    into = torch.empty(2)
    operations.torch.distributed.all_gather_into_tensor(into, mine)
    return {"gather": gather(mine).tolist(), "into": into.tolist(),
            "sum": reduce(mine, reduction="sum").tolist(), "mean": reduce(mine).tolist(),
            "max": reduce(mine, reduction="max").tolist(),
            "broadcast": broadcast(mine.clone(), from_process=1).tolist(),
            "padded": pad_across_processes(torch.ones(index + 1)).tolist()}


FUNCTIONS = {"offset": offset_rollout, "server": server_rollout, "seeded": seeded_rollout}


class _Process:
    """What ``trainer`` looks like to one of ``size`` processes of a data-parallel run (the one-process reference):
    ``accelerator.process_index`` / ``num_processes`` and the processes' gathered prompts."""

    def __init__(self, trainer, index: int, size: int, everything: list) -> None:
        self._trainer, self.index, self.num_processes, self.process_index = trainer, index, size, index
        self.everything = everything

    @property
    def accelerator(self):
        return self

    def gather_for_metrics(self, data, use_gather_object=False):
        return list(self.everything)

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def as_processes(function, size: int):
    """``function`` called as ``size`` processes of TRL's data-parallel run would call it, each on its contiguous part
    of the global batch; their outputs joined (the one-process reference of ``size`` replicas)."""
    from ds_usp.integration.trainers.rollout import merge_rollout_outputs

    def rollout(prompts: list, trainer) -> dict:
        n = len(prompts) // size
        parts = [function(prompts[k * n:(k + 1) * n], _Process(trainer, k, size, prompts)) for k in range(size)]
        return merge_rollout_outputs(parts, [n] * size)

    return rollout


def _recorded(completions, **kwargs):
    COMPLETIONS.append(list(completions))
    return [0.0] * len(completions)


# ---- the runs ------------------------------------------------------------------------------------------------------

def _grpo(model_dir: str, out: str, layout: tuple, function, use_usp: bool, split: bool = True):
    import ds_usp  # noqa: F401 - registers "usp" and the deepspeed.initialize hook
    from trl import GRPOConfig, GRPOTrainer

    from test_hf_trainer import _fresh_accelerate

    _, stage, u, r, order = layout
    cls = ds_usp.USPGRPOTrainer if use_usp else GRPOTrainer
    if not split:  # every rank generates the group's whole batch (the rollout_func: still once per group)
        cls = type(cls.__name__, (cls,), {"split_rollouts": False})
    _fresh_accelerate()
    replicas = 4 // (u * r) if use_usp else 1  # the same global batch of 8 completions (2 prompts) per step
    args = GRPOConfig(**_common(out, _ds_config(stage, u, r, order) if use_usp else None),
                      per_device_train_batch_size=8 // replicas, num_generations=4, max_completion_length=16,
                      temperature=0.8, beta=0.0, shuffle_dataset=False, loss_type="dapo")
    trainer = cls(model=model_dir, reward_funcs=[_reward_even, _reward_long, _recorded], args=args,
                  train_dataset=_prompts(16), processing_class=_tokenizer(), rollout_func=function)
    trainer.train()
    return trainer


def train(model_dir: str, out: str, layout: tuple, name: str, split: bool = True) -> dict:
    """On every rank: USPGRPOTrainer with the rollout function ``name`` (``split``: split rollouts); its logs, final
    parameters, calls and the completions of each rollout."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # (ZeRO-3's zero.Init reads deepspeed.comm's world size)
    CALLS.clear()
    COMPLETIONS.clear()
    FREE.clear()
    trainer = _grpo(model_dir, f"{out}/{name}", layout, {**FUNCTIONS, **MORE}[name], True, split)
    return {**_summary(trainer, layout[1]), "calls": list(CALLS), "completions": list(COMPLETIONS),
            "free": list(FREE)}


def _reference(model_dir: str, out: str, layout: tuple, name: str, replicas: int) -> dict:
    CALLS.clear()
    COMPLETIONS.clear()
    with _one_process():
        trainer = _grpo(model_dir, out, layout, as_processes(FUNCTIONS[name], replicas), False)
        return {**_summary(trainer, 0), "completions": list(COMPLETIONS)}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rollout_func_is_told_what_trl_tells_one_process(world4, model_dirs, tmp_path_factory, layout, name):
    _check_against_one_process(world4, model_dirs, tmp_path_factory, LAYOUTS[layout], name, True)


MORE = {"free-server": free_server_rollout}  # name -> a function checked at one layout only
REFERENCE_OF = {"free-server": "server"}  # its one-process reference: the same completions as this function's


@pytest.mark.parametrize("name, layout, split", [
    ("free-server", ("llama", 2, 2, 1, "zigzag"), True),  # accelerate's free gather_object, broadcast_object_list
    ("offset", ("llama", 3, 2, 1, "zigzag"), False),  # split_rollouts = False, ZeRO-3: still once per group
], ids=["free-functions-zero2-2x1-2-replicas", "unsplit-zero3-2x1-2-replicas"])
def test_collectives_in_the_call_and_unsplit_rollouts(world4, model_dirs, tmp_path_factory, name, layout, split):
    results = _check_against_one_process(world4, model_dirs, tmp_path_factory, layout, name, split)
    if name == "free-server":  # the 2 replicas' first ranks, processes 0 and 1 (values 1 and 2), took part
        for k in (0, 2):
            assert results[k]["free"] == [{"gather": [1.0, 2.0], "into": [1.0, 2.0], "sum": [3.0], "mean": [1.5],
                                           "max": [2.0], "broadcast": [2.0], "padded": [1.0, 1.0 if k else 0.0]}] * 3


def _check_against_one_process(world, model_dirs, tmp_path_factory, case: tuple, name: str, split: bool) -> list:
    """The function ``name`` at layout ``case`` trains as in one process (every rollout's completions, every logged
    metric, every final parameter) and is called once per rollout on each group's first rank only; each rank's
    results."""
    sp, replicas = case[2] * case[3], 4 // (case[2] * case[3])
    path = model_dirs[case[0]]
    results = world.run(train, path, str(tmp_path_factory.mktemp("usp")), case, name, split)
    want = _reference(path, str(tmp_path_factory.mktemp("ref")), case, REFERENCE_OF.get(name, name), replicas)
    rows = 8 // replicas
    for replica in range(replicas):  # each replica's completions: its part of one process's, every rollout
        got = results[replica * sp]["completions"]
        assert got == [c[replica * rows:(replica + 1) * rows] for c in want["completions"]], (replica, got)
    assert all(res["completions"] == results[k - k % sp]["completions"] for k, res in enumerate(results))
    _same(results[0], want)
    for k, res in enumerate(results):  # called once per rollout, on each group's first rank, as replica k // sp
        assert res["calls"] == ([(k // sp, rows)] * 3 if k % sp == 0 else []), (k, res["calls"])
    return results


def failing_rollout(prompts: list, trainer) -> dict:
    """A generation server that is down."""
    CALLS.append((trainer.accelerator.process_index, len(prompts)))
    raise ConnectionError("the generation server is down")


def train_failing(model_dir: str, out: str, layout: tuple) -> dict:
    """On every rank: USPGRPOTrainer with :func:`failing_rollout`; what ``train`` raised and the calls made."""
    CALLS.clear()
    try:
        _grpo(model_dir, out, layout, failing_rollout, True)
    except Exception as error:  # noqa: BLE001 - what each rank raised is the case's result
        return {"raised": f"{type(error).__name__}: {error}", "calls": list(CALLS)}
    return {"raised": None, "calls": list(CALLS)}


def test_a_failure_on_the_first_rank_is_raised_on_every_rank_of_its_group(world4, model_dirs, tmp_path_factory):
    """The function raises on each group's first rank (the only rank that calls it): the group's other ranks, which
    wait for its output, raise too, naming the failure, instead of waiting forever (2 replicas of 2x1)."""
    results = world4.run(train_failing, model_dirs["llama"], str(tmp_path_factory.mktemp("fail")),
                         ("llama", 2, 2, 1, "zigzag"))
    for k, res in enumerate(results):
        if k % 2 == 0:
            assert res == {"raised": "ConnectionError: the generation server is down", "calls": [(k // 2, 4)]}, k
        else:
            assert res["calls"] == [] and res["raised"].startswith("RuntimeError: rollout_func failed on the first "
                                                                  "rank of this sequence-parallel group"), (k, res)
            assert "the generation server is down" in res["raised"], (k, res)
