"""Offload storage: hot tokens on the device (``storage``), whole cold pages in host memory or on disk
(``cold``), the device's LRU of fetched pages (``page_lru``)."""
