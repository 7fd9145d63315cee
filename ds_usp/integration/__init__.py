"""Training integration, in sub-packages by concern: ``ds_usp.initialize`` and checkpoints (:mod:`.engine`), batch
sharding, the loader and dynamic SP's plans (:mod:`.data`), model adaptation with HuggingFace's
``attn_implementation="usp"`` and diffusion transformers (:mod:`.models`), the training step's memory and the SP
loss (:mod:`.step`), the HF / TRL trainers (:mod:`.trainers`)."""
