"""Every change ds-usp makes to third-party code, one module per upstream project, each patch checking the upstream
behaviour it relies on before it applies (:mod:`.registry`; importing this package registers every patch's record)."""
from ds_usp.integration.upstream import (  # noqa: F401 - their records
    accelerate, c10d, deepspeed, diffusers, torch, transformers, transformers_trainer, triton, trl)
