"""``kvcompress check-policy NAME [--storage S] [--check C ...]``: the generic policy contract
(``kvcompress.harness.contract``) on a registered policy, from an installed package: a plugin author's
selector (its YAML in a folder of ``KVCOMPRESS_CONF_PATH``, its module importable) needs neither the source
checkout nor pytest. Prints PASS or FAIL per check and model family; exits 1 when any check fails."""

from __future__ import annotations

import argparse
import sys

from kvcompress.harness.contract import CHECKS, run_checks
from kvcompress.harness.contract.tiny import FAMILIES, small_policy


def _policy(name: str, storage: str | None):
    """The policy ``name`` (over ``storage``) at its small test parameters; ValueError or ImportError, by
    name, for what cannot be built."""
    from kvcompress.core.cache import make_policy
    from kvcompress.core.registry import make_storage

    policy = small_policy(make_policy(name))
    if storage is None:
        return policy
    params = type(make_storage(storage)).TEST_PARAMS
    return small_policy(make_policy(name, storage={"name": storage, **(params[0] if params else {})}))


def main(argv: list[str] | None = None) -> int:
    """Run the checks and print one line each; 0 when all pass, 1 when one fails or NAME cannot be built."""
    parser = argparse.ArgumentParser(prog="kvcompress check-policy", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a registered policy (kvcompress.known_policies(), plugins included)")
    parser.add_argument("--storage", help="a registered storage to run it over (its first TEST_PARAMS)")
    parser.add_argument("--check", action="append", choices=sorted(CHECKS), help="run only these checks")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="only these model families")
    args = parser.parse_args(argv)
    try:
        policy = _policy(args.name, args.storage)
    except (ValueError, ImportError, AttributeError) as err:
        print(f"FAIL build: {err}", file=sys.stderr)
        return 1
    print(f"check-policy {args.name}{f' over {args.storage}' if args.storage else ''}: {policy}")
    failed = 0
    for check, family, error in run_checks(policy, tuple(args.family or FAMILIES), args.check):
        failed += error is not None
        print(
            f"{'PASS' if error is None else 'FAIL'} {check} [{family}]{'' if error is None else ': ' + error}"
        )
    total = len(args.check or CHECKS) * len(args.family or FAMILIES)
    print(f"{total - failed} of {total} passed" + (f"; {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
