"""The oldest HF stack ds-usp supports, LLaMA-Factory 0.9.5's pins (transformers 5.6.0, accelerate 1.11.0, TRL 0.24.0,
with the huggingface_hub, tokenizers and datasets releases they resolve to): a subset of the suite runs in a virtual
environment that holds them before this environment's packages.

The subset is what those frameworks use: the HF Trainer path with subclasses that override ``compute_loss`` and
``prediction_step``, equal to one process (tests/test_frameworks.py: LLaMA-Factory's SFT trainer with 2 replicas,
axolotl's at 2 x 1 ZeRO-3), a loss from the logits refused, the JSON key's batch gate, and the refusal of ds-usp's
SFT and RL trainers by name where TRL 0.24 lacks the fused LM head they run on. The whole
suite runs at the newest versions (setup.py's dev extra). Skipped where the package index has none of the pins (a
machine without the index): the suite then runs at the newest set only.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_json_key import _env, _site_dirs

ROOT = Path(__file__).resolve().parent.parent
# LLaMA-Factory 0.9.5's ceilings and what pip resolves beside them (huggingface_hub < 2 for transformers 5.6)
OLDEST = ("transformers==5.6.0", "accelerate==1.11.0", "trl==0.24.0", "tokenizers==0.22.2", "huggingface_hub==1.33.0",
          "httpx==0.28.1", "httpcore==1.0.9", "datasets==4.0.0", "fsspec==2025.3.0", "dill==0.3.8",
          "multiprocess==0.70.16", "pandas==2.3.3", "pytz==2026.6", "tzdata==2026.6")
SUBSET = ["tests/test_frameworks.py", "-k", "llamafactory_sft-zero2 or axolotl-zero3 or logits or "
          "counted_over_every_rank or test_rl_trainers_are_refused_by_name",
          "tests/test_json_key.py", "tests/test_oldest.py"]


def test_rl_trainers_are_refused_by_name():
    """At a TRL without the fused LM head (0.24), ds-usp's RL trainers and its SFTTrainer (checked when the trainer
    is created, before any group) are refused naming what is missing; at the newest they are there."""
    import trl.trainer.utils as utils

    import ds_usp
    from ds_usp.upstream.trl import require_fused_head

    if hasattr(utils, "add_fused_lm_head"):
        assert ds_usp.USPGRPOTrainer.__name__ == "USPGRPOTrainer"
        require_fused_head("USPSFTTrainer")
    else:
        with pytest.raises(ImportError, match=r"RL trainers .* which TRL 0\.24\.0 does not have .*add_fused_lm_head"):
            ds_usp.USPGRPOTrainer  # noqa: B018
        with pytest.raises(ImportError, match=r"USPSFTTrainer under .* TRL 0\.24\.0 does not have"):
            require_fused_head("USPSFTTrainer")


@pytest.mark.skipif("ds_usp_oldest" in sys.modules, reason="this is the run at the oldest versions")
def test_the_subset_passes_at_the_oldest_versions(tmp_path):
    where = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=300)
    python = str(where / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               env=_env(), capture_output=True, text=True, timeout=120, check=True).stdout.strip())
    (site / "zz_running_environment.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    (site / "ds_usp_oldest.py").write_text("")  # marks the run (the nested run skips this test)
    pip = [python, "-m", "pip", "install", "--no-deps", "--quiet"]
    env = _env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    got = subprocess.run([*pip, *OLDEST], env=env, capture_output=True, text=True, timeout=900)
    if got.returncode and "No matching distribution" in got.stderr:
        pytest.skip(f"the package index has not every pin: {got.stderr.strip()[-300:]}")
    assert got.returncode == 0, got.stdout + got.stderr
    done = subprocess.run([*pip, "-e", str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    versions = subprocess.run([python, "-c", "import transformers, accelerate, trl; import ds_usp_oldest; print("
                               "transformers.__version__, accelerate.__version__, trl.__version__)"],
                              env=env, capture_output=True, text=True, timeout=300)
    assert versions.stdout.split() == ["5.6.0", "1.11.0", "0.24.0"], versions.stdout + versions.stderr
    run = subprocess.run([python, "-c", "import ds_usp_oldest, sys, pytest; sys.exit(pytest.main(sys.argv[1:]))",
                          "-q", "-p", "no:cacheprovider", *SUBSET], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=2400)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0 and " passed" in run.stdout, tail
