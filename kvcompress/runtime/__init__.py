"""Feeding a model through a policy cache: chunked prefill, the context pass of query-agnostic selectors
(KVzip), several left-padded sequences in one batch."""
