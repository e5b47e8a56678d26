"""Cache files written before the package was laid out by layer (format version 2: their headers carry no
version) load through this explicit table; files written since carry ``"version": 3``. (Version 1, before
headers held code digests, is refused: it cannot say which code wrote it.)

``MOVED`` renames the modules (and packages) such a file names (and ``FIELDS`` the fields of its
configs renamed since): layer, store and nested classes, the
``_target_`` of its policy config, the modules of its code digests. ``DIGESTS`` (generated from the commit
before the move, ``BEFORE``, by ``scripts/persist_aliases.py``) pairs each module's digest then with its new
module's digest at the move: a file whose code was the code of the move is read as if written now; a digest
that differs (other code, or a module changed since) stays, and the usual check refuses the file, naming it.
"""

from __future__ import annotations

VERSION = 3  # 2: before the move (no "version" in the header); 1: before code digests
BEFORE = "fa1acd7"

MOVED = {  # old module -> new module, below ``kvcompress.``
    "attention": "core.attention",
    "cache": "core.cache",
    "executor": "core.executor",
    "plan": "core.plan",
    "masks": "core.masks",
    "fused": "core.fused",
    "forward_state": "core.forward_state",
    "families": "core.families",
    "fields": "core.fields",
    "profiling": "core.profiling",
    "registry": "core.registry",
    "sources": "core.sources",
    "spec": "core.spec",
    "placement": "core.placement",
    "policies.base": "core.policy",
    "policies.layer": "core.layer",
    "policies.layer_attention": "core.layer_attention",
    "policies.context_mode": "core.context_mode",
    "policies.model_window": "core.model_window",
    "storage.base": "core.storage",
    "storage.buffers": "core.buffers",
    "assets": "resources.assets",
    "data": "resources.data",
    "models": "resources.models",
    "packed_linears": "resources.packed_linears",
    "backends": "kernels.backends",
    "fused_quant": "kernels.fused_quant",
    "fused_pages": "kernels.fused_pages",
    "fused_low_rank": "kernels.fused_low_rank",
    "storage.quant": "storage.quant.kivi",
    "storage.quantizer": "storage.quant.quantizer",
    "storage.low_rank": "storage.low_rank.storage",
    "storage.low_rank_bases": "storage.low_rank.bases",
    "storage.low_rank_config": "storage.low_rank.config",
    "storage.low_rank_store": "storage.low_rank.store",
    "calibration": "storage.low_rank.calibration",
    "calibration_files": "storage.low_rank.calibration_files",
    "calibration_queries": "storage.low_rank.calibration_queries",
    "calibration_text": "storage.low_rank.calibration_text",
    "storage.offload": "storage.offload.storage",
    "storage.cold": "storage.offload.cold",
    "storage.page_lru": "storage.offload.page_lru",
    "persist_file": "persist.file",
    "state": "persist.state",
    "policies.config": "persist.config",
    "context_pass": "runtime.context_pass",
    "padding": "runtime.padding",
    "policies": "selectors",
    "policies.eviction": "selectors.eviction.base",
    "policies.chunks": "selectors.eviction.chunks",
    "policies.h2o": "selectors.eviction.h2o",
    "policies.snapkv": "selectors.eviction.snapkv",
    "policies.tova": "selectors.eviction.tova",
    "policies.expected_attention": "selectors.eviction.expected_attention",
    "policies.kvzip": "selectors.eviction.kvzip",
    "policies.kvzip_budgets": "selectors.eviction.kvzip_budgets",
    "policies.kvzip_scores": "selectors.eviction.kvzip_scores",
    "policies.block_evict": "selectors.eviction.block_evict",
    "policies.block_evict_layer": "selectors.eviction.block_evict_layer",
    "policies.rope": "selectors.eviction.rope",
    "policies.pyramid": "selectors.eviction.pyramid",
    "policies.block_sparse": "selectors.pages.block_sparse",
    "policies.block_sparse_layer": "selectors.pages.block_sparse_layer",
    "policies.tiered": "selectors.pages.tiered",
    "policies.tiered_layer": "selectors.pages.tiered_layer",
    "app": "harness.app",
    "cli": "harness.cli",
    "sweep": "harness.sweep",
    "results": "harness.results",
    "report": "harness.report",
    "plots": "harness.plots",
    "guard": "harness.guard",
    "tasks": "harness.tasks",
    "docgen": "harness.docgen",
    "loggers": "harness.loggers",
}
MOVED = {f"kvcompress.{k}": f"kvcompress.{v}" for k, v in MOVED.items()}
FIELDS = {"residual_length": "recent"}  # config fields renamed since (``fields.RENAMED``)
CLASS_KEYS = ("class", "store_class", "object", "namedtuple", "_target_")


def new_name(dotted: str) -> str:
    """``dotted`` (a module, or a module and a name in it) under the new layout: its longest moved prefix
    renamed."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        prefix = ".".join(parts[:n])
        if prefix in MOVED:
            return MOVED[prefix] + dotted[len(prefix) :]
    return dotted


def upgrade(header: dict) -> dict:
    """A header with no version (written before the move) read as the current layout (``MOVED`` and
    ``DIGESTS``); any other returned as it is (its version is checked by the reader)."""
    if not isinstance(header, dict) or "version" in header:
        return header
    return {**_renamed(header), "version": VERSION}


def _renamed(node):
    if isinstance(node, list):
        return [_renamed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    config = isinstance(node.get("_target_"), str)  # a policy or storage config: its fields' names too
    for key, value in node.items():
        key = FIELDS.get(key, key) if config else key
        if key in CLASS_KEYS and isinstance(value, str):
            out[key] = new_name(value)
        elif key == "code" and isinstance(value, dict):
            out[key] = dict(_code(name, digest) for name, digest in value.items())
        else:
            out[key] = _renamed(value)
    return out


def _code(name: str, digest):
    """A recorded module digest under the new layout: the new module's digest at the move when the file's
    is the old module's at the move, else the file's own (which the reader then refuses)."""
    new, before, after = DIGESTS.get(name, (new_name(name), None, None))
    return new, (after if digest == before else digest)


# -- generated by scripts/persist_aliases.py --
DIGESTS = {
    "kvcompress": ("kvcompress", "26518e2e2c44eab3", "80546b3a3127e258"),
    "kvcompress.app": ("kvcompress.harness.app", "80d4502f1d40324a", "5e4a620d4b4561a8"),
    "kvcompress.assets": ("kvcompress.resources.assets", "593d8292d8195589", "593d8292d8195589"),
    "kvcompress.attention": ("kvcompress.core.attention", "528450335a32c15a", "5c9b4d621649eb08"),
    "kvcompress.backends": ("kvcompress.kernels.backends", "f3b8e6b3516ccc48", "ad9b923b4c5b8c61"),
    "kvcompress.cache": ("kvcompress.core.cache", "2ace43bd280fdc52", "2d5fcdfe146e37ea"),
    "kvcompress.calibration": (
        "kvcompress.storage.low_rank.calibration",
        "587cce42a43dcc92",
        "e8b5fb629d1644af",
    ),
    "kvcompress.calibration_files": (
        "kvcompress.storage.low_rank.calibration_files",
        "053bbc2feb608b9d",
        "0950f16e086a4ddc",
    ),
    "kvcompress.calibration_queries": (
        "kvcompress.storage.low_rank.calibration_queries",
        "f9e4b103f047199b",
        "fa0f929649c499d0",
    ),
    "kvcompress.calibration_text": (
        "kvcompress.storage.low_rank.calibration_text",
        "4db3ad353a4e8c4a",
        "e491839a86e9088a",
    ),
    "kvcompress.cli": ("kvcompress.harness.cli", "3252384b616814b4", "74a8da5519975e35"),
    "kvcompress.context_pass": ("kvcompress.runtime.context_pass", "8f8f6bdd04e7a5e5", "23babda88033c9f9"),
    "kvcompress.data": ("kvcompress.resources.data", "5491e424787f4480", "8f179c4770f4a9a2"),
    "kvcompress.docgen": ("kvcompress.harness.docgen", "287f12f56ff4f937", "38732d5b7ec47764"),
    "kvcompress.docgen.blocks": ("kvcompress.harness.docgen.blocks", "e200f89ff8ac6ea0", "478c63eea760a091"),
    "kvcompress.docgen.catalog": (
        "kvcompress.harness.docgen.catalog",
        "d9fb666b576afca3",
        "cf9d49e414040ef3",
    ),
    "kvcompress.docgen.compare": (
        "kvcompress.harness.docgen.compare",
        "0b478cf42a12dd2e",
        "3f014f019165091e",
    ),
    "kvcompress.docgen.decode": ("kvcompress.harness.docgen.decode", "db0b2e6e408db2a0", "06f754f4f327f5de"),
    "kvcompress.docgen.records": (
        "kvcompress.harness.docgen.records",
        "70eecece50a825bf",
        "d717eb9aa324d2b5",
    ),
    "kvcompress.eval": ("kvcompress.eval", "7994fea4e209d89c", "7994fea4e209d89c"),
    "kvcompress.eval.adapter": ("kvcompress.eval.adapter", "d2c69dc58de2eb14", "92f33326948ce904"),
    "kvcompress.eval.batching": ("kvcompress.eval.batching", "c691de7f86e486ae", "c8d781c3c1aca530"),
    "kvcompress.eval.calibration_guard": (
        "kvcompress.eval.calibration_guard",
        "ec23ca22fa12835f",
        "3edc58bd91c26f47",
    ),
    "kvcompress.eval.cli": ("kvcompress.eval.cli", "89ccddc98e59a51c", "89ccddc98e59a51c"),
    "kvcompress.eval.docs": ("kvcompress.eval.docs", "2617d543833c9521", "61c43fbdf77c2983"),
    "kvcompress.eval.hydra_task": ("kvcompress.eval.hydra_task", "1c20721f2ce539da", "1c20721f2ce539da"),
    "kvcompress.eval.lm_tasks.utils": (
        "kvcompress.eval.lm_tasks.utils",
        "59a68bbc61b7aacf",
        "59a68bbc61b7aacf",
    ),
    "kvcompress.eval.streamed": ("kvcompress.eval.streamed", "d7710d01b951dca3", "d7710d01b951dca3"),
    "kvcompress.eval.taskdata": ("kvcompress.eval.taskdata", "0ed2c738ec781d37", "48e295bd8088b3bb"),
    "kvcompress.executor": ("kvcompress.core.executor", "c9167322c50e4651", "547f20f9d1b1d3cd"),
    "kvcompress.families": ("kvcompress.core.families", "b8e066746e0d745d", "b8e066746e0d745d"),
    "kvcompress.fields": ("kvcompress.core.fields", "e05b406920365a4e", "cec1ba223f970989"),
    "kvcompress.forward_state": ("kvcompress.core.forward_state", "e5487aa6cc539b44", "e5487aa6cc539b44"),
    "kvcompress.fused": ("kvcompress.core.fused", "844c413d874660a5", "e3a8306f375ee073"),
    "kvcompress.fused_low_rank": (
        "kvcompress.kernels.fused_low_rank",
        "72a0a37d28a886e0",
        "72a0a37d28a886e0",
    ),
    "kvcompress.fused_pages": ("kvcompress.kernels.fused_pages", "bb880e7d2f11569f", "7f85dfd8eed4d7b1"),
    "kvcompress.fused_quant": ("kvcompress.kernels.fused_quant", "45638e0629d23b16", "7850c5c1a0a01279"),
    "kvcompress.guard": ("kvcompress.harness.guard", "78cff50623589ffd", "78cff50623589ffd"),
    "kvcompress.kernels": ("kvcompress.kernels", "e7c39bd801a22e7a", "2ef1376a60ed0c42"),
    "kvcompress.loggers": ("kvcompress.harness.loggers", "5c96b7818afc07ff", "37f8934cb8557ec8"),
    "kvcompress.loggers.jsonl": ("kvcompress.harness.loggers.jsonl", "9f3294676cf7a6fc", "087b309f25fbdbf5"),
    "kvcompress.loggers.wandb_run": (
        "kvcompress.harness.loggers.wandb_run",
        "866ab236eef00c26",
        "8144c491e5a9d762",
    ),
    "kvcompress.masks": ("kvcompress.core.masks", "5d099a2ddf9c586a", "1398c35081dfafc0"),
    "kvcompress.memory_model": ("kvcompress.memory_model", "9e4a3001ad382120", "32ceb2a054f0eeec"),
    "kvcompress.memory_model.core": ("kvcompress.memory_model.core", "a5a2bbbc7725dd94", "f0558a2d905e2023"),
    "kvcompress.metrics": ("kvcompress.metrics", "184d7ad290b58be6", "184d7ad290b58be6"),
    "kvcompress.metrics.compression": (
        "kvcompress.metrics.compression",
        "dabda3ee6e305a0b",
        "fbc8651a06815fe2",
    ),
    "kvcompress.metrics.fidelity": ("kvcompress.metrics.fidelity", "452b4a6781fa93aa", "95a2bb95a235a7be"),
    "kvcompress.metrics.memory": ("kvcompress.metrics.memory", "65f248edd111afa0", "8e26dc2b78b9ae85"),
    "kvcompress.metrics.perplexity": (
        "kvcompress.metrics.perplexity",
        "739b4f03ec6240c0",
        "ecfd068b8f30bbf0",
    ),
    "kvcompress.metrics.speed": ("kvcompress.metrics.speed", "ec70950b2f47cb44", "34332fac403d0410"),
    "kvcompress.metrics.stats": ("kvcompress.metrics.stats", "644a3978a85f977b", "644a3978a85f977b"),
    "kvcompress.models": ("kvcompress.resources.models", "0e604fe19275a0ca", "0d6dc178e17f2e74"),
    "kvcompress.packed_linears": (
        "kvcompress.resources.packed_linears",
        "284979582832e086",
        "284979582832e086",
    ),
    "kvcompress.padding": ("kvcompress.runtime.padding", "31e2ecb980cf79e9", "f4197c36d82d7163"),
    "kvcompress.persist": ("kvcompress.persist", "9cf0c60d82273bc8", "cb926751c1557fc1"),
    "kvcompress.persist_file": ("kvcompress.persist.file", "671b0552df1f8d26", "37399ee6db205d55"),
    "kvcompress.placement": ("kvcompress.core.placement", "c0f3f3df0f100f61", "c0f3f3df0f100f61"),
    "kvcompress.plan": ("kvcompress.core.plan", "24466fbf9cbc6e32", "28303c7bc43fc7cb"),
    "kvcompress.plots": ("kvcompress.harness.plots", "c1deefede46f0c7a", "2f3b543aaf317914"),
    "kvcompress.policies": ("kvcompress.selectors", "43813673d66de38a", "ab096343d02ee6eb"),
    "kvcompress.policies.base": ("kvcompress.core.policy", "e566e74169727071", "0d2dc2cb2c5ad474"),
    "kvcompress.policies.block_evict": (
        "kvcompress.selectors.eviction.block_evict",
        "c548a2ebc459cf3d",
        "737d8a16cc63480f",
    ),
    "kvcompress.policies.block_evict_layer": (
        "kvcompress.selectors.eviction.block_evict_layer",
        "baab628338b6c5b8",
        "7def931c5099df45",
    ),
    "kvcompress.policies.block_sparse": (
        "kvcompress.selectors.pages.block_sparse",
        "eec7a39d953f37b3",
        "c457059a32e6e3a1",
    ),
    "kvcompress.policies.block_sparse_layer": (
        "kvcompress.selectors.pages.block_sparse_layer",
        "a4559f042df1b597",
        "7b501a6350863feb",
    ),
    "kvcompress.policies.chunks": (
        "kvcompress.selectors.eviction.chunks",
        "4f2aec34fc2570a7",
        "4f2aec34fc2570a7",
    ),
    "kvcompress.policies.config": ("kvcompress.persist.config", "cca16bbccaa539de", "dd30530eb7362138"),
    "kvcompress.policies.context_mode": (
        "kvcompress.core.context_mode",
        "e70db94bd5f8ddd0",
        "7bf5c17eb1787818",
    ),
    "kvcompress.policies.eviction": (
        "kvcompress.selectors.eviction.base",
        "d535ea8786e630c0",
        "a58a1db60f62a748",
    ),
    "kvcompress.policies.expected_attention": (
        "kvcompress.selectors.eviction.expected_attention",
        "cf11d91f938c1eaf",
        "b1c537e82bda5d52",
    ),
    "kvcompress.policies.full": ("kvcompress.selectors.full", "30e0d2fe057b3597", "01909295e40454c8"),
    "kvcompress.policies.h2o": ("kvcompress.selectors.eviction.h2o", "b0264d2567c844a6", "af0940104857da4f"),
    "kvcompress.policies.kvzip": (
        "kvcompress.selectors.eviction.kvzip",
        "126c910bbb6ad3cd",
        "de4039b4708c572e",
    ),
    "kvcompress.policies.kvzip_budgets": (
        "kvcompress.selectors.eviction.kvzip_budgets",
        "312cd4dc41fd9e50",
        "312cd4dc41fd9e50",
    ),
    "kvcompress.policies.kvzip_scores": (
        "kvcompress.selectors.eviction.kvzip_scores",
        "63ca21a5e896bcdb",
        "c1649f720ec4ac61",
    ),
    "kvcompress.policies.layer": ("kvcompress.core.layer", "9d1fa6b6bc26fc8c", "794f286e82f8d10f"),
    "kvcompress.policies.layer_attention": (
        "kvcompress.core.layer_attention",
        "776b7358324489b9",
        "fa0fbd241096b20d",
    ),
    "kvcompress.policies.low_rank": ("kvcompress.selectors.low_rank", "c9ced910107b8194", "182e0fabe4885496"),
    "kvcompress.policies.model_window": (
        "kvcompress.core.model_window",
        "a5e6040d1afdc6ae",
        "f26fbecf7d6999f4",
    ),
    "kvcompress.policies.pyramid": (
        "kvcompress.selectors.eviction.pyramid",
        "f604e46d8d06dbca",
        "b441f4d9211cd245",
    ),
    "kvcompress.policies.quant": ("kvcompress.selectors.quant", "33f9959a377cff33", "fcb8c5914bdae048"),
    "kvcompress.policies.rope": (
        "kvcompress.selectors.eviction.rope",
        "f399bbc4b0be1170",
        "f399bbc4b0be1170",
    ),
    "kvcompress.policies.schedule": ("kvcompress.selectors.schedule", "ccea40a27cc0a7c0", "3d52ea520adefddd"),
    "kvcompress.policies.sliding_window": (
        "kvcompress.selectors.sliding_window",
        "85772e93e18bd854",
        "82246d9764f87216",
    ),
    "kvcompress.policies.snapkv": (
        "kvcompress.selectors.eviction.snapkv",
        "221041abb756117c",
        "08d8ef87c38895d6",
    ),
    "kvcompress.policies.tiered": (
        "kvcompress.selectors.pages.tiered",
        "c631340266af9179",
        "86f049e24c40799e",
    ),
    "kvcompress.policies.tiered_layer": (
        "kvcompress.selectors.pages.tiered_layer",
        "71a6555219f131f2",
        "3e424ea9c70ca959",
    ),
    "kvcompress.policies.tova": (
        "kvcompress.selectors.eviction.tova",
        "35204e71cdcfc721",
        "05d49f846f521aad",
    ),
    "kvcompress.policies.window_layer": (
        "kvcompress.selectors.window_layer",
        "b6462990bb3750f9",
        "699f371bbb08dad5",
    ),
    "kvcompress.profiling": ("kvcompress.core.profiling", "4977440a3fa338f4", "4977440a3fa338f4"),
    "kvcompress.registry": ("kvcompress.core.registry", "696ab4aeb853ad10", "eeb7c44d2e994f39"),
    "kvcompress.report": ("kvcompress.harness.report", "52d6ee38d9f79b30", "be4ef1132aabf707"),
    "kvcompress.results": ("kvcompress.harness.results", "764cecbba318c72c", "c5f356416374d03b"),
    "kvcompress.sources": ("kvcompress.core.sources", "297c44101c72fea3", "ebe7d6bbc809f061"),
    "kvcompress.spec": ("kvcompress.core.spec", "77e7899d4c31d413", "77e7899d4c31d413"),
    "kvcompress.state": ("kvcompress.persist.state", "d7b7e851a2519e99", "0db6a90bdcbd13ce"),
    "kvcompress.storage": ("kvcompress.storage", "c74eb30508c1aaa2", "9f8aae1f49a4fdae"),
    "kvcompress.storage.base": ("kvcompress.core.storage", "d3561fa811def090", "e3448e03403c8831"),
    "kvcompress.storage.buffers": ("kvcompress.core.buffers", "05b8b6d6e3d14a3b", "05b8b6d6e3d14a3b"),
    "kvcompress.storage.cold": ("kvcompress.storage.offload.cold", "b54b9a1bd68980a9", "a74c726d329621b4"),
    "kvcompress.storage.dense": ("kvcompress.storage.dense", "bf9777a6c0e37701", "80966fef19c084de"),
    "kvcompress.storage.low_rank": (
        "kvcompress.storage.low_rank.storage",
        "b43b0af3c07da3a9",
        "488a68ff8e165d92",
    ),
    "kvcompress.storage.low_rank_bases": (
        "kvcompress.storage.low_rank.bases",
        "91514b7a35a683f4",
        "91514b7a35a683f4",
    ),
    "kvcompress.storage.low_rank_config": (
        "kvcompress.storage.low_rank.config",
        "90938a0e499af29a",
        "454be34386ad4645",
    ),
    "kvcompress.storage.low_rank_store": (
        "kvcompress.storage.low_rank.store",
        "c3f2aad002e05c21",
        "b7a92a48c6023d45",
    ),
    "kvcompress.storage.offload": (
        "kvcompress.storage.offload.storage",
        "7fe555922e16d2c7",
        "3a0bb8422e4595e6",
    ),
    "kvcompress.storage.page_lru": (
        "kvcompress.storage.offload.page_lru",
        "f4bcb1c24a27ce0f",
        "f4bcb1c24a27ce0f",
    ),
    "kvcompress.storage.quant": ("kvcompress.storage.quant.kivi", "4da23bd0b30a660b", "f9163ed2c4588feb"),
    "kvcompress.storage.quantizer": (
        "kvcompress.storage.quant.quantizer",
        "76cced179cab3d68",
        "2e27cc3620b881e0",
    ),
    "kvcompress.storage.residual": ("kvcompress.storage.residual", "d8ac1aac50f517cb", "c0fcffac77f831ba"),
    "kvcompress.storage.rope": ("kvcompress.storage.rope", "24ef1582090c74ac", "24ef1582090c74ac"),
    "kvcompress.storage.rope_table": (
        "kvcompress.storage.rope_table",
        "0d8aaefca3bed3e1",
        "0d8aaefca3bed3e1",
    ),
    "kvcompress.storage.split": ("kvcompress.storage.split", "c0b03f291857088f", "5f12d0de6f21cf3d"),
    "kvcompress.sweep": ("kvcompress.harness.sweep", "ff3f380ef3e3ea77", "be4a1bec287b4e4a"),
    "kvcompress.tasks": ("kvcompress.harness.tasks", "ccdd523738b4fe60", "ccdd523738b4fe60"),
    "kvcompress.tasks.batched": ("kvcompress.harness.tasks.batched", "58b3063e15f24698", "5d56995a46fef746"),
    "kvcompress.tasks.bench": ("kvcompress.harness.tasks.bench", "fe57c7ba46126f68", "6dc1cca3be255131"),
    "kvcompress.tasks.compare": ("kvcompress.harness.tasks.compare", "7ba8019222908b13", "7c034416be54b271"),
    "kvcompress.tasks.compare_report": (
        "kvcompress.harness.tasks.compare_report",
        "ee4541f19ef9af52",
        "ee4541f19ef9af52",
    ),
    "kvcompress.tasks.conversation": (
        "kvcompress.harness.tasks.conversation",
        "82bda1e5d39fa719",
        "e6fa5054ec50b168",
    ),
    "kvcompress.tasks.fidelity": (
        "kvcompress.harness.tasks.fidelity",
        "1f1888d0eca2b377",
        "71950c9b673bbd3b",
    ),
    "kvcompress.tasks.fidelity_report": (
        "kvcompress.harness.tasks.fidelity_report",
        "d8d3ee6500ebd611",
        "bc338f35007b5632",
    ),
    "kvcompress.tasks.grid": ("kvcompress.harness.tasks.grid", "7a1feec9d606297c", "7e95d79a58cc6a00"),
    "kvcompress.tasks.multi_batched": (
        "kvcompress.harness.tasks.multi_batched",
        "32f2ab871d4dee41",
        "c8a3745e195952d1",
    ),
    "kvcompress.tasks.multi_niah": (
        "kvcompress.harness.tasks.multi_niah",
        "adc5ec24dab35e66",
        "1c66b65c96d4b681",
    ),
    "kvcompress.tasks.niah": ("kvcompress.harness.tasks.niah", "2f4ec581500164cf", "44b4dbabea30f944"),
    "kvcompress.tasks.passkey": ("kvcompress.harness.tasks.passkey", "7af8b49658a50c37", "d7a59a34872a2f17"),
    "kvcompress.tasks.perplexity": (
        "kvcompress.harness.tasks.perplexity",
        "5658992b179f3a78",
        "4928d5e9f6391738",
    ),
    "kvcompress.tasks.retrieval": (
        "kvcompress.harness.tasks.retrieval",
        "4838bc5de977ec27",
        "fc12d76a49e4abdf",
    ),
    "kvcompress.tasks.slices": ("kvcompress.harness.tasks.slices", "f963a86bff09b3ff", "f963a86bff09b3ff"),
}
# -- end of generated table --
