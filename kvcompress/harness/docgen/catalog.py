"""Tables derived from the code itself: the selectors and storages (``conf/`` + their classes), each one's
declared fields, and the memory model's predicted bytes. Nothing here is typed by hand."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from kvcompress.core.fields import _KEY
from kvcompress.core.registry import CONF_DIR, import_target, load
from kvcompress.harness.report import markdown_table

ARXIV = re.compile(r"arXiv[ :]*(\d{4}\.\d{4,5})")


def _yaml(group: str, name: str) -> str:
    return (CONF_DIR / group / f"{name}.yaml").read_text(encoding="utf-8")


def _target(group: str, name: str):
    match = re.search(r"^_target_:\s*(\S+)", _yaml(group, name), re.M)
    return import_target(match.group(1))


def papers(cls, yaml_text: str = "") -> str:
    """The arXiv papers a class's module and YAML cite, as links ("—" when none)."""
    text = (inspect.getmodule(cls).__doc__ or "") + (cls.__doc__ or "") + yaml_text
    ids = list(dict.fromkeys(ARXIV.findall(text)))
    return ", ".join(f"[arXiv {i}](https://arxiv.org/abs/{i})" for i in ids) or "—"


def first_line(cls, short: bool = False) -> str:
    """The docstring's summary paragraph; with ``short`` its first sentence."""
    text = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    if short:
        text = re.split(r"(?<=[a-z)`])\. ", text)[0].rstrip(".") + "."
    return text


def arg_docs(cls) -> dict[str, str]:
    """``name: text`` entries of the Args sections of ``cls``'s docstring and its bases' (Google style), and
    of its storage's for a storage preset."""
    found: dict[str, str] = {}
    presets = [cls.storage_class] if getattr(cls, "storage_class", None) else []  # a preset's fields
    for klass in [*cls.__mro__, *presets]:
        doc = inspect.cleandoc(klass.__doc__ or "")
        section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
        for m in re.finditer(r"^ {4}([\w /]+?): (.+?)(?=^ {4}[\w /]+?: |\Z|^\S)", section, re.M | re.S):
            text = " ".join(m.group(2).split())
            for name in m.group(1).split(" / "):
                if not text.startswith("see "):  # a pointer to a base class: its own entry comes later
                    found.setdefault(name.strip(), text)
    return found


def kind_of(name: str) -> str:
    """``selector``, ``preset`` (a storage under ``full``) or ``schedule`` of a ``conf/policy`` name."""
    from kvcompress.core.cache import make_policy
    from kvcompress.selectors import SchedulePolicy, StoragePreset

    policy = make_policy(name)
    return "schedule" if isinstance(policy, SchedulePolicy) else "preset" if isinstance(
        policy, StoragePreset) else "selector"  # fmt: skip


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _catalog(group: str, wanted, short: bool = False) -> str:
    from kvcompress.core.cache import make_policy

    rows = []
    for name in names(group):
        if not wanted(name):
            continue
        cls = _target(group, name)
        paper = papers(cls, _yaml(group, name))
        row = {group: f"`{name}`", "what it does": first_line(cls, short), "paper": paper}
        if group == "policy" and not short:  # at its defaults: never | always (every step) | prefill
            row["evicts"] = getattr(make_policy(name), "evicts", "")
        rows.append(row)
    return markdown_table(rows, list(rows[0]))


def selectors_block(args, options, root: Path, md_path: Path) -> str:
    """``selectors [kinds=selector,preset,schedule]``: one line per ``conf/policy`` entry of those kinds."""
    kinds = options.get("kinds", "selector").split(",")
    return _catalog("policy", lambda n: kind_of(n) in kinds, "short" in args)


def storages_block(args, options, root: Path, md_path: Path) -> str:
    """``storages``: one line per ``conf/storage`` entry."""
    return _catalog("storage", lambda n: True, "short" in args)


def allowed(f: dataclasses.Field) -> str:
    """What a declared field accepts, from its declaration (``kvcompress.core.fields``)."""
    rule = f.metadata.get(_KEY)
    if rule is None:
        return ""
    kind = rule[0]
    if kind == "int":
        _, low, high, null = rule
        text = f"integer >= {low}" + (f", <= {high}" if high is not None else "")
    elif kind == "float":
        _, low, high, lo_open, hi_open, null = rule
        text = f"{'(' if lo_open else '['}{low:g}, {high:g}{')' if hi_open else ']'}"
    elif kind == "choice":
        return " \\| ".join(f"`{c}`" for c in rule[1])
    else:
        return "true \\| false"
    return text + (" or null" if null else "")


def fields_block(args, options, root: Path, md_path: Path) -> str:
    """``fields GROUP NAME``: each field the class of ``GROUP/NAME`` declares: its default there (the YAML's
    value where it sets one), what it accepts (declared in the class), and what it means: the YAML's comment
    on it (``field: value  # ...`` or ``#   field: ...``), else the docstring's."""
    group, name = args
    text, cls = _yaml(group, name), _target(group, name)
    declared, docs, comments = {f.name: f for f in dataclasses.fields(cls)}, arg_docs(cls), _comments(text)
    rows = []
    for field, value in load(group, name).items():
        if field == "_target_":
            continue
        meaning = (comments.get(field) or docs.get(field, "")).replace("|", "\\|").replace("<", "&lt;")
        rows.append({"field": f"`{field}`", "default": f"`{_shown(value)}`",
                     "accepts": allowed(declared[field]), "meaning": meaning})  # fmt: skip
    if not rows:
        return f"_`{name}` has no fields._"
    return markdown_table(rows, ["field", "default", "accepts", "meaning"])


def _comments(text: str) -> dict[str, str]:
    """``{field: comment}`` from a YAML's ``field: value  # comment`` and ``#   field: comment`` lines."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s*.*?\s*#\s*(.*)$", line) or re.match(r"^#\s+(\w+): (.+)$", line)
        if m and m.group(1) != "_target_":
            found.setdefault(m.group(1), m.group(2).strip())
    return found


def _shown(value) -> str:
    """A default as YAML writes it (a nested config by its class's name)."""
    if isinstance(value, dict) and "_target_" in value:
        return value["_target_"].rpartition(".")[2]
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def memory_block(args, options, root: Path, md_path: Path) -> str:
    """``memory TOKENS DECODE [dtype_bytes=4]``: predicted bytes of every ``conf/policy`` at its defaults on
    the embedded model's shape (30 layers, 9 / 3 heads, head_dim 64), from the memory model alone."""
    from kvcompress.core.cache import make_policy
    from kvcompress.memory_model import predicted_bytes
    from kvcompress.selectors import ModelSpec

    tokens, decode = int(args[0]), int(args[1])
    dtype_bytes = int(options.get("dtype_bytes", 4))
    spec = ModelSpec(30, 9, 3, 64, max_positions=0)
    full = predicted_bytes("full", spec, tokens, dtype_bytes, decode_tokens=decode)
    rows = []
    for name in names("policy"):
        pred = predicted_bytes(make_policy(name), spec, tokens, dtype_bytes, decode_tokens=decode)
        ratio, per_token = (None, None) if pred is None else (pred / full, round(pred / (tokens + decode)))
        rows.append(
            {"policy": f"`{name}`", "predicted_bytes": pred, "vs_full": ratio, "per_token": per_token}
        )
    return markdown_table(rows, list(rows[0])) + (
        "\n\n_Empty: no formula (the bytes depend on calibration or scores). "
        f"{tokens}-token prompt + {decode} decode steps, {dtype_bytes}-byte elements. "
        "Regenerate: `make results`._"
    )
