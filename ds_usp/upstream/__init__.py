"""Every change ds-usp makes to third-party code, one module per upstream project, each patch checking the upstream
behaviour it relies on before it applies (:mod:`.registry`). Importing this package imports none of its modules:
a caller imports the one project's module it uses (``ds_usp.comm`` only :mod:`.c10d`), and :mod:`.catalog` imports
them all for the whole table of patches."""
