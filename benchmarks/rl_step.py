"""One GRPO step with generation (issue 51): TRL in one process, ds-usp with every rank generating the group's whole
batch (``split_rollouts = False``, as before issue 51), and ds-usp with each rank generating its share.

Run:

    python benchmarks/rl_step.py --zero 2,3 --json rl_step.json

One global batch of ``--prompts`` prompts x ``--gens`` generations (prompts of about ``--prompt-len`` random tokens,
left-padded), ``--completion`` sampled tokens each (``min_new_tokens`` keeps every row that long, so each system
generates the same number of tokens per row), GRPO ``dapo``, SGD. The model is long_seq.py's Llama (vocab 32000, hidden
256, intermediate 896, 4 layers, 8 heads), random weights. Every system samples with the keyed sampler
(``KeyedRolloutMixin`` on TRL's trainer), so all three train on the same completions.

Systems, each a fresh job:

* ``TRL one process``: ``GRPOTrainer`` without DeepSpeed, the whole batch on one process;
* ``ds-usp redundant``: ``USPGRPOTrainer`` on 4 ranks (``--ulysses`` x ``--ring``, ZeRO ``--zero``) with
  ``split_rollouts = False``: each rank generates the whole batch and keeps its group's first rank's;
* ``ds-usp split``: the same with split rollouts (the default): each rank generates a quarter of the rows.

Measured per step after ``--warmup`` steps (the median over the timed steps; for ds-usp the slowest rank):
``generation_s``, the wall time of TRL's ``_generate`` (the rollout, ds-usp's gather of the shares included);
``update_s``, the wall time of the step less ``_prepare_inputs`` (generation and scoring): the policy's forward and
backward and the optimizer step; ``peak_mib``, the growth of the resident set over the step (the largest rank's).
Because 4 ranks share this machine's cores, wall times also count the waiting for a core: the work is shown by
``generation_cpu_s`` (the generating thread's CPU seconds, summed over the ranks) and ``tokens_generated`` (summed
over the ranks: the redundant system generates every token once per rank), with per rank the rows and tokens it
generated and its model's forward calls during generation. The completions of every step must be
identical across the systems, and the loss and every logged metric equal to TRL's at 1e-4 (checked).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, comma_list, job_port, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[rl_step]"
_PORTS = itertools.count()
VOCAB = 32000
SYSTEMS = {"trl": "TRL one process", "redundant": "ds-usp redundant", "split": "ds-usp split"}
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch", "total_flos",
          "train_loss")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t3")


def _save_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 14, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    _tokenizer().save_pretrained(path)


def _prompts(n: int, length: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    lens = [max(1, length - 8 * (i % 4)) for i in range(n)]  # a few lengths: left padding in every batch
    return Dataset.from_dict({"prompt": [" ".join(f"t{t}" for t in torch.randint(4, VOCAB, (m,), generator=g).tolist())
                                         for m in lens]})


def _reward(completions, **kwargs):
    return [sum(int(t[1:]) % 2 == 0 for t in c.split()) / max(1, len(c.split())) for c in completions]


class _Meter:
    """Times a trainer's step, its ``_prepare_inputs`` and ``_generate``; counts the tokens this rank generates."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.current: dict = {}

    def count_forward(self, module, args) -> None:
        self.current["forwards"] += 1

    def wrap(self, cls: type, trl_class: type) -> type:
        meter = self

        def training_step(self, *args, **kwargs):
            meter.current = {"generation_s": 0.0, "generation_cpu_s": 0.0, "prepare_s": 0.0, "tokens": 0,
                             "rows": 0, "forwards": 0, "completions": None}
            base = reset_peak()
            start = time.perf_counter()
            out = super(timed, self).training_step(*args, **kwargs)
            meter.current["step_s"] = time.perf_counter() - start
            meter.current["peak_mib"] = (read_peak() - base) / 2 ** 20
            meter.steps.append(meter.current)
            return out

        def _prepare_inputs(self, *args, **kwargs):
            start = time.perf_counter()
            out = super(timed, self)._prepare_inputs(*args, **kwargs)
            meter.current["prepare_s"] += time.perf_counter() - start
            return out

        def _generate(self, prompts):
            start, cpu = time.perf_counter(), time.thread_time()
            hook = self.model.register_forward_pre_hook(meter.count_forward)  # the model's whole forwards
            try:
                out = super(timed, self)._generate(prompts)
            finally:
                hook.remove()
            meter.current["generation_s"] += time.perf_counter() - start
            meter.current["generation_cpu_s"] += time.thread_time() - cpu
            meter.current["completions"] = hashlib.sha1(json.dumps(out[1]).encode()).hexdigest()[:16]
            return out

        timed = type(cls.__name__, (cls,), {"training_step": training_step, "_prepare_inputs": _prepare_inputs,
                                            "_generate": _generate})
        original = trl_class._generate_single_turn

        @functools.wraps(original)
        def counting(self, prompt_ids, *args, **kwargs):  # TRL's call (below ds-usp's split): this rank's rows
            out = original(self, prompt_ids, *args, **kwargs)
            meter.current["tokens"] += sum(len(c) for c in out[0])
            meter.current["rows"] += len(prompt_ids)
            return out

        trl_class._generate_single_turn = counting
        return timed


def run_job(args: argparse.Namespace) -> dict:
    """One system: a few GRPO steps; per step the times, the peak and this rank's tokens (every rank's on rank 0)."""
    torch.set_num_threads(1)
    import ds_usp
    from trl import GRPOConfig, GRPOTrainer

    from ds_usp.integration.trainers.rl import KeyedRolloutMixin

    usp = args.role != "trl"
    stage = args.zero_stage
    ds = None
    if usp:
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "sequence_parallel": "usp", "sequence_parallel_size": args.ulysses * args.ring,
              "usp": {"ulysses_degree": args.ulysses, "ring_degree": args.ring, "layout": "zigzag",
                      "timeout_seconds": 3600}}
    base = ds_usp.USPGRPOTrainer if usp else type("GRPOTrainer", (KeyedRolloutMixin, GRPOTrainer), {})
    meter = _Meter()
    cls = meter.wrap(base, GRPOTrainer)
    rows = args.prompts * args.gens
    config = GRPOConfig(output_dir=tempfile.mkdtemp(), deepspeed=ds, use_cpu=True, max_steps=args.warmup + args.steps,
                        logging_steps=1, report_to=[], bf16=False, save_strategy="no", learning_rate=0.01, optim="sgd",
                        max_grad_norm=1.0, seed=0, per_device_train_batch_size=rows, num_generations=args.gens,
                        max_completion_length=args.completion, temperature=0.9, top_k=50, beta=0.0,
                        loss_type="dapo", shuffle_dataset=False, generation_kwargs={"min_new_tokens": args.completion},
                        model_init_kwargs={"attn_implementation": "usp" if usp else "sdpa", "dtype": torch.float32})
    trainer = cls(model=args.model_dir, reward_funcs=[_reward], args=config,
                  train_dataset=_prompts(rows * (args.warmup + args.steps), args.prompt_len),
                  processing_class=_tokenizer())
    trainer.split_rollouts = args.role != "redundant"
    trainer.train()
    logs = [{k: v for k, v in h.items() if k not in TIMING and isinstance(v, (int, float))}
            for h in trainer.state.log_history]
    row = {"steps": meter.steps, "logs": [h for h in logs if len(h) > 1]}
    if not usp:
        return row
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, meter.steps)
    return {**row, "ranks": every} if dist.get_rank() == 0 else {}


def _summary(name: str, row: dict, warmup: int) -> dict:
    """The system's row: medians over the timed steps of the slowest rank's times, the largest rank's peak, the
    generation CPU seconds and tokens summed over the ranks."""
    ranks = row.get("ranks") or [row["steps"]]
    timed = [[steps[k] for steps in ranks] for k in range(warmup, len(ranks[0]))]  # per step: every rank's
    med = lambda values: statistics.median(values)  # noqa: E731
    return {"system": name,
            "generation_s": med([max(r["generation_s"] for r in step) for step in timed]),
            "update_s": med([max(r["step_s"] - r["prepare_s"] for r in step) for step in timed]),
            "peak_mib": med([max(r["peak_mib"] for r in step) for step in timed]),
            "score_s": med([max(r["prepare_s"] - r["generation_s"] for r in step) for step in timed]),
            "generation_cpu_s": med([sum(r["generation_cpu_s"] for r in step) for step in timed]),
            "generation_s_per_rank": [med([step[i]["generation_s"] for step in timed]) for i in range(len(ranks))],
            "tokens_generated": med([sum(r["tokens"] for r in step) for step in timed]),
            "tokens_generated_per_rank": [med([step[i]["tokens"] for step in timed]) for i in range(len(ranks))],
            "rows_generated_per_rank": [med([step[i]["rows"] for step in timed]) for i in range(len(ranks))],
            "generation_forwards_per_rank": [med([step[i]["forwards"] for step in timed]) for i in range(len(ranks))],
            "ranks": len(ranks), "completions": [r["completions"] for r in ranks[0]]}


def _job(role: str, zero: int, args: argparse.Namespace, model_dir: str) -> dict:
    out = Path(tempfile.mkdtemp()) / f"rl_step_{role}.json"
    flags = ["--prompts", args.prompts, "--gens", args.gens, "--prompt-len", args.prompt_len, "--completion",
             args.completion, "--steps", args.steps, "--warmup", args.warmup, "--ulysses", args.ulysses, "--ring",
             args.ring, "--zero-stage", zero, "--model-dir", model_dir, "--role", role, "--out", out]
    env = {"TRL_EXPERIMENTAL_SILENCE": "1"}
    if role == "trl":  # TRL's own trainer, one process
        start_ranks(__file__, flags, env=env, check=True)
    else:
        start_ranks(__file__, flags, args.ulysses * args.ring, port=job_port(args, next(_PORTS)), env=env, check=True)
    return json.loads(out.read_text())


def _same_logs(got: list, want: list) -> float:
    """The largest relative difference of any logged metric (raises when the keys or step counts differ)."""
    assert len(got) == len(want), (len(got), len(want))
    worst = 0.0
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w), (sorted(g), sorted(w))
        for key in w:
            worst = max(worst, abs(g[key] - w[key]) / max(1e-6, abs(w[key])))
    return worst


def main() -> None:
    p = base_parser(__doc__, master_port=29660)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (global batch)")
    p.add_argument("--gens", type=int, default=4, help="num_generations")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of the longest prompt")
    p.add_argument("--completion", type=int, default=64, help="tokens generated per row")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--ulysses", type=int, default=2)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--zero", type=comma_list(int), default=[2, 3], help="ZeRO stages of the ds-usp systems")
    p.add_argument("--zero-stage", type=int, default=2, help=argparse.SUPPRESS)  # one job's
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    add_job_flags(p)
    args = p.parse_args()
    if run_as_job(args, run_job):
        return
    model_dir = tempfile.mkdtemp(prefix="rl_step_model_")
    _save_model(model_dir)
    load = os.getloadavg()
    trl = _job("trl", 0, args, model_dir)
    rows, checks = [{**_summary(SYSTEMS["trl"], trl, args.warmup), "zero": None}], {}
    for zero in args.zero:
        for role in ("redundant", "split"):
            run = _job(role, zero, args, model_dir)
            row = {**_summary(SYSTEMS[role], run, args.warmup), "zero": zero}
            if row["completions"] != rows[0]["completions"]:
                raise SystemExit(f"{TAG} {row['system']} (ZeRO-{zero}) trained on other completions than TRL")
            worst = _same_logs(run["logs"], trl["logs"])
            checks[f"{role} zero{zero}"] = worst
            if worst > 1e-4:
                raise SystemExit(f"{TAG} {row['system']} (ZeRO-{zero}) logs differ from TRL's by {worst:.2e}")
            rows.append(row)
    for row in rows:
        print(f"{TAG} {row['system']:>18} ZeRO {row['zero'] or '-'}: generation {row['generation_s']:7.2f} s "
              f"(CPU {row['generation_cpu_s']:7.2f} s, {row['tokens_generated']:6.0f} tokens; per rank: rows "
              f"{row['rows_generated_per_rank']}, forwards {row['generation_forwards_per_rank']}), update "
              f"{row['update_s']:6.2f} s, peak {row['peak_mib']:7.1f} MiB", flush=True)
    ratios = {}
    for zero in args.zero:
        redundant, split = (next(r for r in rows if r["system"] == SYSTEMS[k] and r["zero"] == zero)
                            for k in ("redundant", "split"))
        ratios[f"zero{zero}"] = {key: split[key] / redundant[key] for key in
                                 ("generation_s", "generation_cpu_s", "tokens_generated", "update_s")}
        print(f"{TAG} ZeRO-{zero} split / redundant: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                   ratios[f"zero{zero}"].items()), flush=True)
    if args.json:
        path = write_result(args.json, {
            "benchmark": "rl_step", "args": {k: v for k, v in vars(args).items()
                                             if k not in ("role", "out", "model_dir", "zero_stage")},
            "load_average_before": load, "load_average_after": os.getloadavg(), "rows": rows,
            "split_over_redundant": ratios, "logs_max_rel_diff_vs_trl": checks})
        print(f"{TAG} wrote {path}")


if __name__ == "__main__":
    main()
