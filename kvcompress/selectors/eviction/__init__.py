"""Score-based eviction: the shared machinery (``base``) and one module per method (H2O, SnapKV, TOVA,
Expected Attention, KVzip, PyramidKV, block eviction)."""
