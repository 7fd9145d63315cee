"""Batches under sequence parallelism: sharding and documents (:mod:`.batch`), the loader (:mod:`.loader`), dynamic
SP's plans (:mod:`.dynamic`)."""
