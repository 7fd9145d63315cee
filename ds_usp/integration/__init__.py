"""Training integration: ``ds_usp.initialize`` (:mod:`.engine`), batch sharding and the SP loss (:mod:`.data`),
and HuggingFace's ``attn_implementation="usp"`` (:mod:`.hf`)."""
