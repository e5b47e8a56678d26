"""The engine every policy plugs into: the cache and its layer base, the selector and storage contracts, the
attention hook, plans, the executor and its backend registry, config fields, the registry of names, model
families, per-forward state.

Depends on nothing else in kvcompress; everything else depends on it (import-linter checks the layers:
``.importlinter``)."""
