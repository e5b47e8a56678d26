"""The ``peers`` generated block: the kvpress agreement table of docs/methods.md, from a peer record."""

from __future__ import annotations

import json

from kvcompress.harness.docgen.peers import peers_block


def record(tmp_path):
    row = {
        "jaccard_mean": 0.98765, "jaccard_min": 0.5, "kept_ours": 100, "kept_kvpress": 96, "answers_equal": 3,
        "answers_compared": 4,
        "settings": {
            "press": {"name": "AdaKVPress", "alpha_safeguard": 0.2,
                      "press": {"name": "SnapKVPress", "window_size": 64}},
            "ours": {"_target_": "kvcompress.selectors.PyramidKVPolicy", "beta": 20,
                     "policy": {"_target_": "kvcompress.selectors.SnapKVPolicy", "observation_window": 64}},
        },
    }  # fmt: skip
    data = {"model": "tiny", "prompt_tokens": [300, 420], "compression_ratio": 0.5, "methods": {"adakv": row},
            "peers_versions": {"kvpress": "0.5.5", "transformers": "5.2.0"}}  # fmt: skip
    (tmp_path / "record.json").write_text(json.dumps(data))


def test_peers_block_renders_one_row_per_method(tmp_path):
    record(tmp_path)
    body = peers_block(["record.json"], {}, tmp_path, tmp_path / "methods.md")
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "`AdaKVPress(SnapKVPress(window_size=64), alpha_safeguard=0.2)`"
    assert cells[2] == "`PyramidKVPolicy beta=20 policy={SnapKVPolicy observation_window=64}`"
    assert cells[3:] == ["0.988 / 0.500", "100 / 96", "3 / 4"]
    assert "2 needle prompts of 300-420 tokens" in body and "kvpress 0.5.5" in body


def test_peers_block_is_dropped_without_its_record(tmp_path):
    assert peers_block(["gone.json"], {}, tmp_path, tmp_path / "methods.md") is None
    kept = peers_block(["gone.json", "pending"], {}, tmp_path, tmp_path / "methods.md")
    assert "No peer record yet at `gone.json`" in kept
