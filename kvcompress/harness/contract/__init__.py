"""The generic contract every policy keeps (DESIGN.md, "Contract of a policy layer"), as plain functions
that need neither pytest nor the source checkout: ``kvcompress check-policy NAME`` runs them on a registered
policy (a plugin's too), on tiny random Llama and Qwen2 models."""

from kvcompress.harness.contract.checks import CHECKS, run_checks

__all__ = ["CHECKS", "run_checks"]
