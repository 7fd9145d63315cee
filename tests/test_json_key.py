"""The DeepSpeed JSON's key alone (issue 52): programs that never import ds-usp train with USP, or are refused by name.

With ds-usp installed, its ``ds_usp_auto.pth`` installs the gates of the top-level ``_ds_usp_auto`` at interpreter
start. tests/stock_trainer_job.py is a stock script (transformers' ``Trainer``, then TRL's ``SFTTrainer`` given the
model's path; nothing of ds-usp in it) on a tiny Llama and a text data set written here, ZeRO-2, CPU ranks. It runs
twice, with an interpreter that has this checkout installed editable (``pip install -e``, into a virtual environment
seeing this one's packages, as a user's would be):

* the reference: one rank, a DeepSpeed JSON without the key, and ``DS_USP_AUTO=0``. Before training it creates
  ``TrainingArguments`` with the JSON that has the key, which the switch refuses by name (never DeepSpeed's batch-size
  assertion, never silently data parallel); the training itself is DeepSpeed's untouched (no ds-usp imported, the
  stock classes, no mpu);
* under ``accelerate launch`` with 2 processes and a YAML whose ``parallelism_config`` asks for DeepSpeed's sequence
  parallelism (``sp_backend: deepspeed``, ``sp_size: 2``) and whose DeepSpeed JSON has ``"sequence_parallel": "usp"``:
  both trainers become ds-usp's (the layout line logged, the engine's mpu ds-usp's, DeepSpeed's own Ulysses not set
  up), and their train and eval losses equal the reference's.

* TRL's own command line, ``trl sft ... --deepspeed usp.json --use_deepspeed --num_processes 2`` (accelerate's
  launcher, 2 processes): its ``SFTTrainer`` becomes ds-usp's and its train and eval losses equal the reference's.

One launch each, all three at once (every process imports torch, DeepSpeed, transformers and TRL: the module's cost).
The ``deepspeed`` launcher takes the same gates (docs/json_key.md has the command and what it logged); the layout's
per-node count under the ``deepspeed`` launcher with ``use_cpu`` is tests/test_config_topology.py's.
TRL's ``SFTConfig`` gets ``bf16=False`` in the script (its default needs an accelerator). Also here: the
gates one by one in this process, the editable install shipping the ``.pth`` (the plain install's is
tests/test_install.py's), and the start-up cost of a program that does not use DeepSpeed. Ports 29700-29709.
"""
from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "stock_trainer_job.py"
TIMEOUT_S = 600
TOL = dict(rtol=1e-5, atol=1e-6)
TRL_TOL = dict(rtol=5e-5, atol=1e-6)  # TRL's own loss in one process (its fused LM head) vs ds-usp's
OFF = "ds-usp's automatic switch is off (DS_USP_AUTO=0)"
ACCELERATE = "import sys; from accelerate.commands.accelerate_cli import main; sys.exit(main())"
TRL_CLI = "import sys; from trl.cli import main; sys.exit(main())"  # the `trl` console script's entry point
START_FILES = {"ds_usp_auto.pth": "import _ds_usp_auto; _ds_usp_auto.install()\n",
               "ds_usp_auto.start": "_ds_usp_auto:install\n"}


def _env(**extra: str) -> dict:
    """The jobs' environment: CPU ranks over gloo (also on a GPU host), offline, this checkout from the install only
    (its editable mapping), the extension cache the suite uses (DeepSpeed's CPU collectives op is built there once)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": "", **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if "DS_USP_AUTO" not in extra:
        env.pop("DS_USP_AUTO", None)
    return env


_PROBE = ("import sys; import _ds_usp_auto; print(any(getattr(f, '_ds_usp_watcher', False) for f in sys.meta_path), "
          "_ds_usp_auto.__file__)")


def _site_dirs() -> list:
    """The site directories this interpreter reads its packages from: its environment's (a virtual environment's
    first, then the base interpreter's when that one sees them) and the user's, when enabled."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict:
    """A virtual environment seeing this interpreter's packages, with this checkout installed editable into it.

    Not ``venv --system-site-packages``: made from inside a virtual environment, that one sees the base interpreter's
    packages (``venv`` builds on the base executable), not the running environment's, and its build found the base's
    setuptools (one without ``bdist_wheel`` failed the install). Its own site-packages comes first; a path file
    (plain paths: their ``.pth`` files are not run, so this environment's own install of ds-usp stays out) appends
    the running environment's site directories after it. pip builds the editable wheel in an isolated build
    environment, as tests/test_install.py's plain install does: setuptools from the package index, not from either
    environment."""
    where = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=300)
    python = str(where / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=_env(),
                               capture_output=True, text=True, timeout=120, check=True).stdout.strip())
    (site / "zz_running_environment.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    done = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--quiet", "-e", str(ROOT)],
                          env=_env(PIP_DISABLE_PIP_VERSION_CHECK="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"python": python, "site": site}


@pytest.fixture(scope="module")
def python(venv) -> str:
    return venv["python"]


def test_the_editable_install_ships_the_hook(venv, tmp_path):
    """``pip install -e .`` puts the start-up files in site-packages (listed in RECORD, so ``pip uninstall`` removes
    them), and the interpreter then has the finder at start, from this checkout's module."""
    site = venv["site"]
    record = "\n" + (next(site.glob("ds_usp-*.dist-info")) / "RECORD").read_text()
    for name, text in START_FILES.items():
        assert (site / name).read_text() == text and f"\n{name}," in record, name
    out = subprocess.run([venv["python"], "-c", _PROBE], env=_env(), capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    words = out.stdout.split()
    assert words[:1] == ["True"] and Path(words[1]).resolve() == ROOT / "_ds_usp_auto.py", out.stdout + out.stderr


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """A tiny Llama with a word-level tokenizer, a text data set (train 16 rows, test 4), and the DeepSpeed JSONs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("assets")
    words = 61
    vocab = {f"w{i}": i for i in range(words)} | {"<pad>": words, "<eos>": words + 1, "<bos>": words + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=words, eos_token_id=words + 1, bos_token_id=words + 2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    (root / "data").mkdir()
    for split, rows in (("train", 16), ("test", 4)):
        with open(root / "data" / f"{split}.jsonl", "w") as f:
            for _ in range(rows):
                text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(8, 40)))
                f.write(json.dumps({"text": text}) + "\n")
    # as HF users write them ("auto" values); the native op is not built here (its twins give the same numbers)
    plain = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    usp = {**plain, "sequence_parallel": "usp", "sequence_parallel_size": 2, "usp": {"native_op": False}}
    for name, config in (("plain", plain), ("usp", usp)):
        (root / f"{name}.json").write_text(json.dumps(config))
    return {"model": str(root / "model"), "data": str(root / "data"), "root": root,
            "plain": str(root / "plain.json"), "usp": str(root / "usp.json")}


def _start(command: list, env: dict, out: Path) -> tuple:
    """Start a job writing ``out/result.json`` (its output to ``out/log.txt``)."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w")
    job = subprocess.Popen([str(a) for a in command], env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                           cwd=str(out))
    return job, log, out, time.time()


def _finish(started: tuple) -> dict:
    """The job's output and result, once it ended (killed after TIMEOUT_S)."""
    job, log, out, t = started
    try:
        job.wait(timeout=max(1.0, TIMEOUT_S - (time.time() - t)))
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
    log.close()
    text = (out / "log.txt").read_text()
    assert job.returncode == 0, text[-6000:]
    result = out / "result.json"
    return {"log": text, "result": json.loads(result.read_text()) if result.exists() else None, "out": out,
            "wall_s": time.time() - t}


def _accelerate_yaml(where: Path, ds_json: str, processes: int, port: int) -> str:
    path = where / "accelerate.yaml"
    path.write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_json}
  deepspeed_multinode_launcher: standard
machine_rank: 0
main_process_port: {port}
num_machines: 1
num_processes: {processes}
use_cpu: false
parallelism_config:
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
""")
    return str(path)


@pytest.fixture(scope="module")
def runs(python, assets) -> dict:
    """The three runs, at the same time (2 + 2 + 1 ranks on 2 cores: the launchers mostly wait).

    * ``reference``: the script as one rank (the launcher's variables set here), plain DeepSpeed, the switch off;
    * ``accelerate``: ``accelerate launch --config_file sp.yaml stock_trainer_job.py ...``, 2 processes, only the
      JSON has the key;
    * ``trl_cli``: TRL's own ``trl sft`` command line, 2 processes (accelerate's launcher with DeepSpeed), the key's
      JSON; it evaluates and saves at its last step, so its trainer_state.json holds the unrounded losses."""
    root = assets["root"]
    (root / "accelerate").mkdir()
    yaml = _accelerate_yaml(root / "accelerate", assets["usp"], 2, 29701)
    accelerate = _start([python, "-c", ACCELERATE, "launch", "--config_file", yaml, JOB, assets["model"],
                         assets["data"], root / "accelerate"], _env(), root / "accelerate")
    sft = ["--model_name_or_path", assets["model"], "--dataset_name", assets["data"], "--dataset_train_split", "train",
           "--dataset_test_split", "test", "--max_length", "32", "--per_device_train_batch_size", "2",
           "--per_device_eval_batch_size", "2", "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3",
           "--max_grad_norm", "1.0", "--seed", "0", "--report_to", "none", "--bf16", "False", "--eval_strategy",
           "steps", "--eval_steps", "3", "--save_strategy", "steps", "--save_steps", "3", "--use_cpu",
           "--output_dir", root / "trl_cli", "--deepspeed", assets["usp"]]
    trl_cli = _start([python, "-c", TRL_CLI, "sft", *sft, "--use_deepspeed", "--num_processes", "2",
                      "--main_process_port", "29702"], _env(), root / "trl_cli")
    one_rank = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29700")
    try:
        reference = _start([python, JOB, assets["model"], assets["data"], root / "reference", "--deepspeed",
                            assets["plain"], "--use_cpu", "--probe_refusal", assets["usp"]],
                           _env(DS_USP_AUTO="0", **one_rank), root / "reference")
        reference = _finish(reference)
    finally:
        try:
            accelerate = _finish(accelerate)
        finally:
            trl_cli = _finish(trl_cli)
    return {"reference": reference, "accelerate": accelerate, "trl_cli": trl_cli}


@pytest.fixture(scope="module")
def reference(runs) -> dict:
    return runs["reference"]


@pytest.fixture(scope="module")
def under_accelerate(runs) -> dict:
    return runs["accelerate"]


def test_without_the_key_deepspeed_is_untouched_and_with_the_switch_off_the_key_is_refused(reference):
    got = reference["result"]
    assert got["refused"] is not None and OFF in got["refused"] and '"sequence_parallel"' in got["refused"], got
    assert got["refused"].startswith("ValueError") and "TrainingArguments" in got["refused"], got
    assert "train_batch_size is not equal to" not in reference["log"]
    assert (got["ds_usp_imported"], got["initialize_gated"]) == (False, True), got  # gated, passed through
    for name, cls in (("trainer", "Trainer"), ("sft", "SFTTrainer")):
        assert (got[name]["trainer"], got[name]["attention"], got[name]["mpu"]) == (cls, "sdpa", "NoneType"), got
        assert len(got[name]["loss"]) == 3, got
    assert "sequence_parallel=usp" not in reference["log"]


def _same(got: dict, want: dict, tol: dict) -> None:
    assert len(got["loss"]) == len(want["loss"]) == 3, (got, want)
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), **tol)
    torch.testing.assert_close(torch.tensor(got["eval_loss"]), torch.tensor(want["eval_loss"]), **tol)


def test_stock_trainers_under_accelerate_with_a_parallelism_config_train_with_usp(under_accelerate, reference):
    log, got = under_accelerate["log"], under_accelerate["result"]
    layouts = [x for x in log.splitlines() if "sequence_parallel=usp: ulysses_degree=" in x]
    assert len(layouts) == 2, log[-6000:]  # one per trainer
    assert all("ulysses_degree=2 x ring_degree=1, data_parallel=1" in x and "2 per node from LOCAL_WORLD_SIZE" in x
               for x in layouts), layouts
    assert "Trainer -> USPTrainer, attention 'sdpa' -> 'usp'" in log
    assert "SFTTrainer -> USPSFTTrainer, attention 'sdpa' -> 'usp'" in log
    assert "parallelism_config sp_size=2 is ds-usp's" in log
    assert "UlyssesSPAttentionHF" not in log  # DeepSpeed's own Ulysses is not set up
    assert got["ds_usp_imported"] is True and "refused" not in got, got
    for name, cls in (("trainer", "USPTrainer"), ("sft", "USPSFTTrainer")):
        assert (got[name]["trainer"], got[name]["attention"], got[name]["mpu"]) == (cls, "usp", "USPMpu"), got
    _same(got["trainer"], reference["result"]["trainer"], TOL)
    _same(got["sft"], reference["result"]["sft"], TRL_TOL)


def test_trls_own_command_line_trains_with_usp(runs):
    """``trl sft ... --deepspeed usp.json --use_deepspeed --num_processes 2``: TRL's script, only the JSON has the key;
    its train and eval losses (from the checkpoint's trainer_state.json, unrounded) equal the reference's SFTTrainer."""
    log = runs["trl_cli"]["log"]
    layouts = [x for x in log.splitlines() if "sequence_parallel=usp: ulysses_degree=" in x]
    assert len(layouts) == 1 and "ulysses_degree=2 x ring_degree=1, data_parallel=1" in layouts[0], log[-6000:]
    assert "SFTTrainer -> USPSFTTrainer" in log, log[-6000:]
    state = json.loads((runs["trl_cli"]["out"] / "checkpoint-3" / "trainer_state.json").read_text())
    got = {"loss": [h["loss"] for h in state["log_history"] if "loss" in h],
           "eval_loss": [h["eval_loss"] for h in state["log_history"] if "eval_loss" in h]}
    assert len(got["eval_loss"]) == 1, state["log_history"]
    _same({**got, "eval_loss": got["eval_loss"][0]}, runs["reference"]["result"]["sft"], TRL_TOL)


# ---- the gates themselves: fast, one process ------------------------------------------------------------------------

# A module with DeepSpeed's ``initialize`` signature that records its calls (source text: the off-switch test runs it
# in a process that imports neither pytest nor torch).
STAND_IN = """
import types


def stand_in_deepspeed(calls):
    module = types.ModuleType("deepspeed_stand_in")

    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
                   config=None, mesh_param=None, config_params=None):
        calls.append(dict(model=model, config=config, config_params=config_params))
        return "deepspeed's engine"

    module.initialize = initialize
    return module
"""
exec(STAND_IN)


def test_the_gate_passes_calls_without_the_key_and_hands_the_key_to_ds_usp(monkeypatch, tmp_path):
    import _ds_usp_auto

    calls, routed = [], []
    module = stand_in_deepspeed(calls)  # noqa: F821 - from STAND_IN
    original = module.initialize
    _ds_usp_auto._gate_deepspeed(module)
    _ds_usp_auto._gate_deepspeed(module)  # once: never two wrappers stacked
    assert module.initialize.__wrapped__ is original and module.initialize._ds_usp
    plain = tmp_path / "plain.json"
    plain.write_text('{"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}')
    assert module.initialize(None, "model", config=str(plain)) == "deepspeed's engine"
    assert module.initialize(model="m", config_params={"zero_optimization": {}}) == "deepspeed's engine"
    assert module.initialize(args=types.SimpleNamespace(deepspeed_config=str(plain)), model="m") == "deepspeed's engine"
    assert len(calls) == 3
    monkeypatch.setitem(_ds_usp_auto.HANDLERS, "deepspeed.initialize",
                        lambda orig, call: routed.append((orig, dict(call))) or 1)
    hjson_file = tmp_path / "usp.json"
    hjson_file.write_text('{\n  // DeepSpeed reads hjson\n  "sequence_parallel": "usp",\n}\n')
    for given in ({"config": {"sequence_parallel": "usp"}}, {"config_params": str(hjson_file)},
                  {"args": types.SimpleNamespace(deepspeed_config=str(hjson_file))}):
        assert module.initialize(model="m", **given) == 1
    assert len(calls) == 3 and len(routed) == 3 and all(orig is original for orig, _ in routed)
    assert routed[0][1] == {"model": "m", "config": {"sequence_parallel": "usp"}}


def test_with_the_switch_off_a_program_without_ds_usp_is_refused_by_the_gate(tmp_path):
    """In a process that never imports ds_usp (nor torch): the gate refuses the key, passes a config without it."""
    code = STAND_IN + """
import sys
import _ds_usp_auto
calls = []
module = stand_in_deepspeed(calls)
_ds_usp_auto._gate_deepspeed(module)
assert module.initialize(config={"train_batch_size": 2}) == "deepspeed's engine"
try:
    module.initialize(config={"sequence_parallel": "usp"})
except ValueError as e:
    print("REFUSED", e)
assert "ds_usp" not in sys.modules and "torch" not in sys.modules
"""
    program = "import sys; sys.path.insert(0, %r); exec(%r)" % (str(ROOT), code)
    done = subprocess.run([sys.executable, "-S", "-c", program],
                          env=_env(DS_USP_AUTO="0"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REFUSED" in done.stdout and OFF in done.stdout and "deepspeed.initialize" in done.stdout, done.stdout


def test_the_finder_acts_after_an_import_only(tmp_path, monkeypatch):
    """A watched module gets its callback after it executed (not on ``find_spec``), keeps its own loader, and again
    after a reload; other names are not answered."""
    import importlib
    import importlib.util

    import _ds_usp_auto

    (tmp_path / "jk_watched.py").write_text("VALUE = 1\n")
    (tmp_path / "jk_other.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    _ds_usp_auto.when_imported("jk_watched", lambda m: seen.append(m.VALUE))
    watcher = _ds_usp_auto._watcher()
    try:
        assert importlib.util.find_spec("jk_watched") is not None and seen == []  # transformers' availability checks
        assert watcher.find_spec("jk_other") is None
        import jk_watched

        assert seen == [1] and type(jk_watched.__loader__).__name__ == "SourceFileLoader"
        assert type(jk_watched.__spec__.loader).__name__ == "SourceFileLoader"
        importlib.reload(jk_watched)
        assert seen == [1, 1]
        _ds_usp_auto.when_imported("jk_watched", lambda m: seen.append("now"))  # already imported: runs now
        assert seen == [1, 1, "now"]
    finally:
        watcher.callbacks.pop("jk_watched", None)
        sys.modules.pop("jk_watched", None)


def test_subclasses_and_other_trainers_are_taken_or_refused_by_name():
    """The key alone takes transformers' Trainer and Seq2SeqTrainer, TRL's SFTTrainer and subclasses, their overrides
    of compute_loss and prediction_step included; it refuses another trainer class by name (naming ds-usp's where
    there is one)."""
    from transformers import Seq2SeqTrainer, Trainer
    from trl import GRPOTrainer, SFTTrainer

    from ds_usp import USPSFTTrainer, USPTrainer
    from ds_usp.integration.trainers.trainer import USPTrainerMixin, usp_trainer_class

    assert usp_trainer_class(Trainer) is USPTrainer and usp_trainer_class(SFTTrainer) is USPSFTTrainer

    class Logged(SFTTrainer):
        def training_step(self, *args, **kwargs):  # wrapped through super(): runs under USP too
            return super().training_step(*args, **kwargs)

    made = usp_trainer_class(Logged)
    assert made.__mro__[1:3] == (USPTrainerMixin, USPTrainerMixin.__mro__[1]) and made.__mro__[3] is Logged
    assert usp_trainer_class(Logged) is made

    class OwnLoss(Seq2SeqTrainer):  # LLaMA-Factory's SFT trainer overrides both: they run, called by ds-usp's
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)

    own = usp_trainer_class(OwnLoss)
    assert own.__mro__[1] is USPTrainerMixin and own.__mro__.index(OwnLoss) > 1
    assert own.compute_loss is USPTrainerMixin.compute_loss and own.prediction_step is USPTrainerMixin.prediction_step
    assert usp_trainer_class(Seq2SeqTrainer).__name__ == "USPSeq2SeqTrainer"
    with pytest.raises(ValueError, match=r"trl\..*GRPOTrainer .*use ds_usp\.USPGRPOTrainer instead"):
        usp_trainer_class(GRPOTrainer)


def test_the_switch_refuses_a_plain_trainer_when_ds_usp_is_imported(monkeypatch):
    from transformers import Trainer

    from ds_usp.integration.trainers.trainer import adopt

    monkeypatch.setenv("DS_USP_AUTO", "0")
    trainer = Trainer.__new__(Trainer)
    with pytest.raises(ValueError, match=r"Trainer was given a DeepSpeed config with \"sequence_parallel\", but "
                                         r"ds-usp's automatic switch is off \(DS_USP_AUTO=0\).*Use ds_usp.USPTrainer"):
        adopt(trainer)
    assert type(trainer) is Trainer


def test_accelerates_parallelism_config_is_taken_or_refused(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    from ds_usp.upstream.accelerate import parallelism_config_for_usp

    for var in ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_SP_SIZE", "PARALLELISM_CONFIG_TP_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert parallelism_config_for_usp(None, 2) is None  # no parallelism config: accelerate builds none either
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")  # what an accelerate YAML sets
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    taken = parallelism_config_for_usp(None, 2)
    assert (taken.sp_size, taken.tp_size, taken.cp_size, taken.dp_shard_size) == (1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"sp_size=2, but the DeepSpeed config's sequence_parallel_size is 4"):
        parallelism_config_for_usp(ParallelismConfig(sp_size=2), 4)
    with pytest.raises(ValueError, match=r"asks for tp_size=2, dp_shard_size=2 beside sp_size=2"):
        parallelism_config_for_usp(ParallelismConfig(sp_size=2, tp_size=2, dp_shard_size=2), 2)
    plain = ParallelismConfig(sp_size=1)
    assert parallelism_config_for_usp(plain, 2) is plain  # no sequence parallelism asked of accelerate


def test_the_trainers_early_read_logs_nothing(caplog):
    """``load_usp_config`` chooses degrees without logging: the layout line of ``ds_usp.initialize`` is the real
    choice (the trainers read the config early, before any head count is known)."""
    import logging

    from ds_usp.config import load_usp_config

    with caplog.at_level(logging.DEBUG, logger="ds_usp"):
        config = load_usp_config({"sequence_parallel": "usp"}, 4, local_world_size=4)
    assert config.degrees_chosen_automatically and caplog.records == []


# ---- what the hook costs a program that does not use DeepSpeed ----------------------------------------------------

def test_the_hook_module_imports_only_os_and_sys():
    tree = ast.parse((ROOT / "_ds_usp_auto.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            top.add(node.module)
    assert top == {"os", "sys"}, top  # typing only under TYPE_CHECKING (False): the annotations are strings


def test_the_hook_changes_only_what_the_patch_table_records():
    """The gates are the hook module's only changes of other objects, and each is a registered patch of ds-usp."""
    import _ds_usp_auto
    from test_upstream import offences

    from ds_usp.upstream.catalog import PATCHES

    found = sorted(line.split(": ", 1)[1] for line in offences((ROOT / "_ds_usp_auto.py").read_text()))
    # the spec it returns and the module being created (the import system's, for this import only), the mark on
    # its own wrapper, and the one assignment of each gate
    assert found == ["(a) setattr(gate, _MARK, True)", "(a) setattr(owner, name, gate)",
                     "(a) spec.loader = _Loader(spec.loader, self)",
                     "(a) spec.loader = module.__loader__ = self.loader"], found
    targets = " ".join(p.target for p in PATCHES.values())
    for wrapped in ("deepspeed.initialize", "DeepSpeedConfig.__init__",
                    "HfTrainerDeepSpeedConfig.trainer_config_process", "Trainer.create_accelerator_and_postprocess"):
        assert f"{wrapped} (wrapped once, by the gate _ds_usp_auto installs" in targets, wrapped
    assert set(_ds_usp_auto.GATES) == {"deepspeed", "deepspeed.runtime.config", "transformers.integrations.deepspeed",
                                       "transformers.trainer"}


# In CPU time of the thread (time.thread_time): on a shared machine the wall clock mostly says how busy the other
# jobs are. The module is imported from its compiled form, as from an install (pip compiles it; the first of the runs
# writes it to a cache of its own).
_COST = """
import os, sys, time  # os: site.py imports it in every program (these runs start without site, -S)
sys.path.insert(0, ROOT)
before = set(sys.modules)
t = time.thread_time()
import _ds_usp_auto
_ds_usp_auto.install()
install_s = time.thread_time() - t
watcher = _ds_usp_auto._watcher()
t = time.thread_time()
for _ in range(100000):
    watcher.find_spec("json.decoder", None)
per_import_s = (time.thread_time() - t) / 100000
ours = sorted(set(sys.modules) - before)
print(install_s * 1e3, per_import_s * 1e9, ours)
"""


def test_start_up_pays_nothing_measurable(python, tmp_path):
    """A program that does not use DeepSpeed: at start the hook imports one module of its own (``os`` and ``sys``
    are there anyway: ``site`` imports them) and installs one finder, which answers any other import with one
    dictionary lookup. Installing it costs well under a millisecond of CPU, the finder ~0.1-0.2 microseconds per
    import (~0.2 ms over the ~1100 modules of ``import torch``); docs/json_key.md has the figures and commands."""
    listed = subprocess.run([python, "-c", "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                             "('ds_usp', '_ds_usp_auto', 'deepspeed', 'transformers', 'torch')))"], env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert listed.stdout.split("\n")[0] == "['_ds_usp_auto']", listed.stdout + listed.stderr  # nothing else of ours
    env = _env(PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    runs = []
    for _ in range(6):  # the first compiles; the best of the rest
        out = subprocess.run([sys.executable, "-S", "-c", f"ROOT = {str(ROOT)!r}\n" + _COST], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        install_ms, per_import_ns, extra = out.stdout.split(" ", 2)
        assert extra.strip() == "['_ds_usp_auto']", extra  # the hook imports nothing
        runs.append((float(install_ms), float(per_import_ns)))
    install_ms, per_import_ns = min(r[0] for r in runs[1:]), min(r[1] for r in runs[1:])
    assert install_ms < 2.0 and per_import_ns < 2000, runs  # measured 0.3-0.6 ms and 100-150 ns (2 cores, loaded)


def _deepspeed_configs() -> dict:
    """On every rank of a 2-rank world: DeepSpeed's config built from configs the way zero.Init builds them (no mpu),
    with a batch counted over every rank (what axolotl fills from WORLD_SIZE)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    import ds_usp  # noqa: F401 - fills the gates' handlers

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's own view of the world (torch's is up already)

    counted_everywhere = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                          "sequence_parallel": "usp", "sequence_parallel_size": 2}
    left_out = {k: v for k, v in counted_everywhere.items() if k != "sequence_parallel_size"}
    left_out["sequence_parallel"] = "ulysses"  # the size left to ds-usp: every rank
    plain = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    out = {}
    for name, config in (("counted everywhere", counted_everywhere), ("size left out", left_out), ("plain", plain)):
        given = dict(config)
        built = DeepSpeedConfig(given)
        out[name] = (built.train_batch_size, built.world_size, given == config)
    return out


def test_a_batch_counted_over_every_rank_is_counted_over_replicas(world2):
    """axolotl's ZeRO-3 JSON (``train_batch_size: "auto"``, filled from WORLD_SIZE before any TrainingArguments):
    zero.Init builds DeepSpeed's config without an mpu, and DeepSpeed divides the world by the sequence-parallel size,
    so its batch assertion ``2 != 1 * 1 * 1.0`` fired while the model loaded. The gate counts the batch over the
    replicas (the user's dict unchanged); a config without the key is DeepSpeed's own."""
    for result in world2.run(_deepspeed_configs):
        assert result["counted everywhere"] == (1, 1, True), result
        assert result["size left out"] == (1, 1, True), result
        assert result["plain"] == (2, 2, True), result
