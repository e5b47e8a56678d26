"""``kvcompress --help``: the subcommands, then the config groups a run composes from (the package's and
the extra folders', ``conf_path``), then the config. Hydra's own listing would also show the internal
``declared/`` groups (``hydra_groups``), which no one chooses on the command line."""

from __future__ import annotations

from omegaconf import OmegaConf

from kvcompress.core.conf_path import conf_dirs

SUBCOMMANDS = [  # (usage, what it does)
    ("kvcompress [overrides]", "one run: model x policy x task (-m [overrides]: a sweep)"),
    ("kvcompress ask CONTEXT ...", "answer questions on a context file through a compressed cache (ask -h)"),
    ("kvcompress bench [overrides]", "prefill and decode speed of policies (= task=bench)"),
    (
        "kvcompress compare [overrides]",
        "one prompt with and without the policy, side by side (= task=compare)",
    ),
    ("kvcompress compare RUN_A RUN_B", "two finished runs' metric, or 'not distinguishable' (compare -h)"),
    ("kvcompress check-policy NAME", "the generic contract checks on a registered policy (check-policy -h)"),
]
HIDDEN = ("hydra", "declared")  # Hydra's own groups (hydra/launcher=... still works) and the internal ones


def groups() -> dict[str, list[str]]:
    """``{group: [options]}`` of every config folder, in the order a name is looked up."""
    found: dict[str, set[str]] = {}
    for root in conf_dirs():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in HIDDEN):
            names = {p.stem for p in folder.glob("*.yaml")}
            if names:
                found.setdefault(folder.name, set()).update(names)
    return {group: sorted(names) for group, names in sorted(found.items())}


def template() -> str:
    """The help text as a Hydra help template (``$CONFIG`` is the composed config)."""
    width = max(len(usage) for usage, _ in SUBCOMMANDS)
    commands = "\n".join(f"  {usage:<{width}}  {what}" for usage, what in SUBCOMMANDS)
    listed = "\n".join(f"{group}: {', '.join(names)}" for group, names in groups().items())
    return (
        "kvcompress: KV-cache compression experiments, one model x policy x task per run.\n\n"
        f"== Subcommands ==\n{commands}\n\n"
        "== Configuration groups ==\nCompose your configuration from those groups (group=option); "
        "KVCOMPRESS_CONF_PATH and ./conf add options\n\n"
        f"{listed}\n\n"
        "== Config ==\nOverride anything in the config (foo.bar=value)\n\n$CONFIG\n\n"
        "Each run writes results.json in its output folder (printed at the end). Hydra's own options: "
        "kvcompress --hydra-help\n"
    )


OmegaConf.register_new_resolver("kvc_help", template, replace=True)  # hydra.help.template of config.yaml
