"""Hybrid models on one device (issue 40 item 5): ds-usp's wrapped layers with the kernels the family picks there.

Run (one process; CUDA when there is a GPU, else CPU):

    python benchmarks/gpu_hybrid.py --json gpu_hybrid.json

For each family (tiny random configs of tests/test_linear.py: Qwen3.5's Gated DeltaNet, Jamba's Mamba-1, ...), the
same weights twice: the plain HF model (``sdpa``), and the model through ``ds_usp.initialize`` at world size 1
(``attn_implementation="usp"``, its linear-attention layers wrapped, ZeRO-2, fp32). Both run the family's own
kernels as transformers selects them on that device (flash-linear-attention's delta rule when ``fla`` imports,
mamba-ssm's selective scan when ``mamba_ssm`` imports, else the PyTorch fallbacks): each row names which ran. Rows:
the loss difference and the largest relative gradient difference over the parameters after one forward+backward.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from _common import base_parser, save_results, table, world_of_one

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
TAG = "[gpu_hybrid]"
KERNELS = {"qwen3_5_text": "fla", "qwen3_next": "fla", "olmo_hybrid": "fla", "jamba": "mamba_ssm",
           "nemotron_h": "mamba_ssm", "lfm2": "causal_conv1d"}


def run_family(family: str, device: torch.device, seq: int) -> dict:
    """One family: loss and gradients of ds-usp's model against the plain HF model on ``device``."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    import ds_usp
    from test_linear import _config

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa").to(device)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="usp")
    model.load_state_dict(ref.state_dict())
    engine, *_ = ds_usp.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "sequence_parallel": "usp", "sequence_parallel_size": 1})
    ids = torch.randint(3, 128, (1, seq), generator=torch.Generator().manual_seed(7))
    want = ref(input_ids=ids.to(device), use_cache=False).logits[0, :-1].float()
    want = F.cross_entropy(want, ids[0, 1:].to(device))
    want.backward()
    shard = ds_usp.shard_batch({"input_ids": ids}, engine.usp.topo, layout=engine.usp.layout)
    out = engine(**{k: v.to(engine.device) for k, v in shard.items() if torch.is_tensor(v)})
    engine.backward(out.loss)
    worst, where = 0.0, ""
    for (name, p), (_, q) in zip(ref.named_parameters(), engine.module.named_parameters()):
        if p.grad is None or p.grad.norm() == 0:
            continue
        err = float((deepspeed.utils.safe_get_full_grad(q).to(p.grad) - p.grad).norm() / p.grad.norm())
        if err > worst:
            worst, where = err, name
    kernel = KERNELS.get(family)
    picked = kernel if kernel and importlib.util.find_spec(kernel) else "torch fallback"
    engine.destroy()
    return dict(family=family, device=str(device), seq=seq, kernel=picked, loss=float(want),
                loss_diff=abs(float(out.loss) - float(want)), grad_rel_err=worst, worst_param=where)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--families", default="qwen3_5_text,qwen3_next,jamba,nemotron_h,lfm2")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--tol", type=float, default=1e-3, help="largest relative gradient difference accepted")
    args = p.parse_args(argv)
    world_of_one()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    import ds_usp

    ds_usp.hf.register_usp_attention()
    rows = []
    for family in args.families.split(","):
        try:
            rows.append(run_family(family, device, args.seq))
        except Exception as e:  # noqa: BLE001 - a failing family is a row, the others still run
            rows.append(dict(family=family, device=str(device), error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(f"{TAG} {rows[-1]}", flush=True)
    print(table(rows, ["family", "device", "kernel", "loss", "loss_diff", "grad_rel_err", "worst_param", "error"],
                {"loss": ".4f", "loss_diff": ".2e", "grad_rel_err": ".2e"}))
    print(f"{TAG} results written to {save_results(args.json, vars(args), rows)}")
    bad = [r["family"] for r in rows if r.get("error") or r["loss_diff"] > args.tol or r["grad_rel_err"] > args.tol]
    print(f"{TAG} {'all equal' if not bad else 'differ or failed: ' + ', '.join(bad)} (tolerance {args.tol})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
