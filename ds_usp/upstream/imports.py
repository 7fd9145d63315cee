"""The change the bootstrap (the top-level ``_ds_usp_auto``, standard library only) makes to Python's import system,
recorded here beside the other patches: one finder at the front of ``sys.meta_path``, and the loader of each
module it watches wrapped so that the gates run right after that module executed."""
from __future__ import annotations

from ds_usp.upstream.registry import Patch, register

register("import_finder", Patch(
    "sys.meta_path (one finder inserted at the front by _ds_usp_auto) and the spec loader of the three modules it "
    "watches (deepspeed, transformers.integrations.deepspeed, transformers.trainer)",
    "importlib's finder protocol: find_spec(fullname, path, target) returning a spec whose loader has "
    "create_module / exec_module (checked on every spec: a loader without exec_module is left alone)",
    "a program that never imports ds-usp (the HF Trainer, trl sft, accelerate launch) must still honour or refuse "
    "the \"sequence_parallel\" key; the gates can wrap a function only once its module exists",
    "an entry point DeepSpeed and transformers call for config keys they do not know"))
