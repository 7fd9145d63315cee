"""A USP training job started by the ``deepspeed`` launcher as one of two "nodes" (run by tests/test_launcher.py).

Usage, from the launcher: ``multinode_job.py OUT_DIR``. The config leaves the degrees out, so ds-usp chooses them
from the launcher's ``LOCAL_SIZE`` (ranks per node) and the model's heads: Ulysses inside each node, ring across.
Every rank writes ``OUT_DIR/rank{R}.json``: the chosen degrees, its groups, the environment the launcher gave
it, and the loss of each step (the whole sequence's, the same on every rank).
"""
from __future__ import annotations

import json
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks over gloo, also on a GPU host (the launcher hands out GPU ids)
import torch  # noqa: E402

SEQ, VOCAB, STEPS, LR = 90, 96, 3, 0.05


def model(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def batch(step: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def reference() -> list[float]:
    """One process, the whole sequence: the losses the job must reproduce (SGD, no clipping)."""
    net = model("sdpa")
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = net(**batch(step)).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def main(out: str) -> None:
    import ds_usp

    ds_usp.hf.register_usp_attention()
    net = model("usp")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 2},
              "sequence_parallel": "usp", "sequence_parallel_size": 4}
    engine, *_ = ds_usp.initialize(model=net, model_parameters=net.parameters(), config=config)
    topo = engine.usp.topo
    losses = []
    for step in range(STEPS):
        out_ = engine(**ds_usp.shard_batch(batch(step), topo, layout=engine.usp.layout))
        engine.backward(out_.loss)
        engine.step()
        losses.append(float(out_.loss))
    record = {"ulysses": topo.ulysses_degree, "ring": topo.ring_degree, "ulysses_ranks": list(topo.ulysses_ranks),
              "ring_ranks": list(topo.ring_ranks), "losses": losses,
              "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "WORLD_SIZE")}}
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
