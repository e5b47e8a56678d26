"""The experiment harness: the Hydra app and command line, tasks, sweeps, result records, reports, plots,
generated docs and loggers. Nothing in kvcompress imports it."""
