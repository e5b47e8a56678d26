"""Find generated blocks in Markdown, render them, and rewrite or check the files."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from kvcompress.harness.results import PACKAGE_ROOT
from kvcompress.resources.files import write_text_atomic

FENCE = re.compile(r"(^```.*?^```[ \t]*$)", re.M | re.S)
BLOCK = re.compile(r"<!-- generated: (?P<spec>.*?) -->\n(?P<body>.*?)<!-- /generated -->\n?", re.S)


@dataclass
class DocsReport:
    """What a regeneration found: files rewritten (or differing, under ``check``) and blocks dropped."""

    changed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    blocks: int = 0


def markdown_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The Markdown files that may hold generated blocks: the README, docs/ and experiment READMEs."""
    found = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found += sorted((root / "experiments").glob("*/README.md"))
    return [p for p in found if p.is_file()]


def parse_spec(spec: str) -> tuple[str, list[str], dict]:
    """``"records a/* columns=x,y pending"`` -> ``("records", ["a/*", "pending"], {"columns": "x,y"})``."""
    words = shlex.split(spec)
    if not words:
        raise ValueError("generated block: empty spec (expected a kind such as 'records', 'selectors')")
    args = [w for w in words[1:] if "=" not in w]
    options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    return words[0], args, options


def render(spec: str, root: Path, md_path: Path, write: bool = True) -> str | None:
    """The block's new body, or None when the block is to be dropped (its records are gone)."""
    from kvcompress.harness.docgen import catalog, compare, decode, generation, leaderboard, peers, records

    kind, args, options = parse_spec(spec)
    kinds = {
        "records": records.records_block,
        "pareto": records.pareto_block,
        "rows": records.rows_block,
        "compare": compare.compare_block,
        "decode": decode.decode_block,
        "selectors": catalog.selectors_block,
        "storages": catalog.storages_block,
        "fields": catalog.fields_block,
        "memory": catalog.memory_block,
        "generate": generation.generate_block,
        "leaderboard": leaderboard.block,
        "frontier": leaderboard.frontier_block,
        "peers": peers.peers_block,
    }
    if kind not in kinds:
        raise ValueError(
            f"generated block {spec!r} in {md_path}: unknown kind {kind!r}; known: {sorted(kinds)}"
        )
    return kinds[kind](args, {**options, "_write": write}, root, md_path)


def regenerate_text(text: str, root: Path, md_path: Path, report: DocsReport, write: bool = True) -> str:
    """``text`` with every generated block re-rendered (or dropped)."""

    def one(match: re.Match) -> str:
        report.blocks += 1
        spec = match.group("spec")
        body = render(spec, root, md_path, write)
        if body is None:
            report.dropped.append(f"{md_path.relative_to(root)}: {spec}")
            return ""
        return f"<!-- generated: {spec} -->\n{body.rstrip()}\n<!-- /generated -->\n"

    parts = FENCE.split(text)  # odd parts are fenced code: an example marker there is left alone
    return "".join(part if i % 2 else BLOCK.sub(one, part) for i, part in enumerate(parts))


def regenerate(root: Path = PACKAGE_ROOT, check: bool = False, files: list[Path] | None = None) -> DocsReport:
    """Re-render every generated block; write the files (or, with ``check``, only list those that differ)."""
    report = DocsReport()
    for path in files or markdown_files(root):
        old = path.read_text(encoding="utf-8")
        new = regenerate_text(old, root, path, report, write=not check)
        if new != old:
            report.changed.append(str(path.relative_to(root)))
            if not check:
                write_text_atomic(path, new)
    return report
