"""``ds_usp.initialize`` (:mod:`.initialize`), its checks before anything is built (:mod:`.preflight`), the degrees
(:mod:`.degrees`), checkpoints (:mod:`.checkpoints`)."""
