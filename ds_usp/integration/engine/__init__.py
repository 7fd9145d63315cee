"""``ds_usp.initialize`` (:mod:`.initialize`): the settings read once (:mod:`.settings`), the checks before anything is
built (:mod:`.preflight`), the degrees (:mod:`.degrees`), one adapter per model kind (:mod:`.adapters`), checkpoints
(:mod:`.checkpoints`)."""
