"""Page selection over stored pages: Quest (``block_sparse``) over an uncompressed cache, and ``tiered`` over
an offloaded cold tier."""
