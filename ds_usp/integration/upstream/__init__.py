"""Every change ds-usp makes to third-party code, one module per upstream project, each patch checking the upstream
behaviour it relies on before it applies (:mod:`.registry`)."""
