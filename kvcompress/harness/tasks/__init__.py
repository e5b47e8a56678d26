"""Workloads run by the Hydra app: each is ``run(model, tokenizer, make_cache, cfg) -> metrics``."""
