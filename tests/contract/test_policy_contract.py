"""One contract for every policy in conf/policy/ (a new policy is picked up by itself): the checks of
``kvcompress.harness.contract`` (the same functions ``kvcompress check-policy`` runs against an installed
package), on each tiny model family. The selector x storage product is in
``test_selector_storage_product.py``; that a check can fail is held by
``tests/harness/test_cli_commands.py`` (a plugin whose ``get_seq_length`` counts stored tokens)."""

from __future__ import annotations

import pytest
from conftest import POLICY_NAMES, small

from kvcompress.harness.contract.checks import CHECKS


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_keeps_the_contract(name, check, tiny_model):
    CHECKS[check](small(name), tiny_model)
