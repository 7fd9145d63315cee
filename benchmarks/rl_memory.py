"""RL policy update at length (issue 36): per-rank peak memory of TRL's GRPO update, one process vs ds-usp on 4 ranks.

Run:

    python benchmarks/rl_memory.py --seq 16384 --json rl_memory.json

One step of what ``GRPOTrainer`` runs per micro batch with ``beta > 0``: the reference model's per-token log-probs
(no gradient), then the policy's, and the backward of the GRPO token loss ``-sum(A * logp) / tokens``, both through
TRL's fused LM head call ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``. One row of ``--seq``
tokens: a left-padded prompt (``--pad`` padding tokens, then the prompt) and a ``--completion``-token completion;
the model is long_seq.py's Llama (vocab 32000, hidden 256, intermediate 896, 4 layers, 8 heads), random weights.

Systems, each a fresh job:

* ``TRL, 1 process``: the plain model (sdpa) with TRL's fused head (``add_fused_lm_head``: chunked over tokens and
  vocabulary already) and HF gradient checkpointing, as ``GRPOConfig``'s defaults give it;
* ``ds-usp 4 ranks``: ``USPGRPOTrainer``'s path: ``ds_usp.initialize`` (ZeRO-2, ``"sequence_parallel": "usp"``,
  memory features ``"auto"``) and the same call, which runs each rank on its shard (``--ulysses`` x ``--ring``).

Memory: the growth of the resident set over the step (``5 > /proc/self/clear_refs`` and ``malloc_trim`` before it,
``VmHWM`` minus the resident size then), the largest over the ranks; the same meter for both. The per-token
log-probs of the completion must agree between the systems to 1e-4 (checked, printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_job_flags, base_parser, run_as_job, start_ranks, write_result  # noqa: E402
from long_seq import read_peak, reset_peak  # noqa: E402

TAG = "[rl_memory]"
TEMPERATURE = 0.9


def _model(attn: str, zero_init: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def _batch(seq: int, pad: int, completion: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (1, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :pad] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion] = -100
    advantage = torch.tensor([[0.7]])
    return ids, mask, labels, advantage


def _step(policy, reference, backward, args) -> dict:
    ids, mask, labels, advantage = _batch(args.seq, args.pad, args.completion)
    base = reset_peak()
    start = time.perf_counter()
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    out = policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    logp = out.log_probs[:, -args.completion:]
    loss = -(advantage * logp).sum() / args.completion
    backward(loss)
    seconds = time.perf_counter() - start
    return {"peak_mib": (read_peak() - base) / 2**20, "seconds": seconds, "loss": float(loss),
            "kl_ref_policy": float((ref[:, -args.completion:] - logp.detach()).abs().max()),
            "logp": logp.detach()[0].tolist()}


def run_single(args: argparse.Namespace) -> dict:
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(1)
    policy, reference = _model("sdpa"), _model("sdpa")
    policy.gradient_checkpointing_enable({"use_reentrant": False})
    policy.train()
    reference.eval()
    for model in (policy, reference):
        add_fused_lm_head(model, temperature=TEMPERATURE)
    return _step(policy, reference, lambda loss: loss.backward(), args)


def run_usp(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    import ds_usp
    from ds_usp.integration.step.logprobs import FUSED_HEAD_ATTR, FusedHead
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ds_usp.hf.register_usp_attention()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
              "sequence_parallel": "usp", "sequence_parallel_size": args.ulysses * args.ring,
              "usp": {"ulysses_degree": args.ulysses, "ring_degree": args.ring, "layout": "zigzag"}}
    engines = []
    for model in (_model("usp"), _model("usp")):
        add_fused_lm_head(model, temperature=TEMPERATURE)  # what GRPOTrainer does before the engine exists
        setattr(model, FUSED_HEAD_ATTR, FusedHead(TEMPERATURE))  # what USPGRPOTrainer adds
        engines.append(ds_usp.initialize(model=model, config=dict(config))[0])
    policy, reference = engines
    reference.eval()
    row = _step(policy, reference, policy.backward, args)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, row["peak_mib"])
    row["peak_mib"], row["peak_mib_per_rank"] = max(peaks), peaks
    dist.barrier()
    return row if dist.get_rank() == 0 else {}


def _job(system: str, args: argparse.Namespace) -> dict:
    out = Path(f"/tmp/rl_memory_{os.getpid()}_{system}.json")
    flags = ["--seq", args.seq, "--pad", args.pad, "--completion", args.completion, "--ulysses", args.ulysses,
             "--ring", args.ring, "--role", system, "--out", out]
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions"))}
    start_ranks(__file__, flags, args.ulysses * args.ring if system == "usp" else None, env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--seq", type=int, default=16384, help="tokens of the row")
    p.add_argument("--pad", type=int, default=1000, help="left padding of the prompt")
    p.add_argument("--completion", type=int, default=4096, help="completion tokens (scored)")
    p.add_argument("--ulysses", type=int, default=2)
    p.add_argument("--ring", type=int, default=2)
    add_job_flags(p)
    args = p.parse_args()
    if run_as_job(args, lambda a: run_single(a) if a.role == "single" else run_usp(a)):
        return
    rows = {"TRL, 1 process": _job("single", args), f"ds-usp {args.ulysses * args.ring} ranks": _job("usp", args)}
    (name_a, a), (name_b, b) = rows.items()
    drift = max(abs(x - y) for x, y in zip(a["logp"], b["logp"]))
    for name, row in rows.items():
        print(f"{TAG} {name:>16}: peak {row['peak_mib']:8.1f} MiB  step {row['seconds']:6.1f} s  loss {row['loss']:.6f}")
    print(f"{TAG} peak {name_b} / {name_a}: {b['peak_mib'] / a['peak_mib']:.3f}; completion log-probs max |diff| "
          f"{drift:.2e} (must be < 1e-4)")
    if args.json:
        summary = {k: {kk: vv for kk, vv in v.items() if kk != "logp"} for k, v in rows.items()}
        path = write_result(args.json, {"benchmark": "rl_memory", "args": {k: v for k, v in vars(args).items()
                                                                         if k not in ("role", "out")},
                                        "systems": summary, "peak_ratio": b["peak_mib"] / a["peak_mib"],
                                        "logp_max_abs_diff": drift})
        print(f"{TAG} wrote {path}")
    if drift >= 1e-4:
        raise SystemExit(f"{TAG} the systems disagree on the log-probs ({drift:.2e})")


if __name__ == "__main__":
    main()
