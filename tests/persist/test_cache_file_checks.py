"""Cache files are versioned by the code that wrote them and refused, naming the file and what is wrong, when
that code differs, when they are truncated or corrupt, or when they name a class outside kvcompress and its
plugins (refused before anything is imported); loading puts each layer's tensors on that layer's device
and runs no calibration pass only to overwrite its result."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import make_tiny, small
from helpers import held_tensors, stream_logits
from safetensors import safe_open
from safetensors.torch import save_file
from test_persistence import assert_same_state

from kvcompress import build_cache, load_cache, save_cache
from kvcompress.core import placement, registry, sources
from kvcompress.core.cache import model_spec
from kvcompress.persist import HEADER_KEY, VERSION
from kvcompress.persist import file as persist_file
from kvcompress.storage.low_rank import calibration
from kvcompress.storage.low_rank.calibration_text import cache_spans

MODEL = make_tiny("llama")
IDS = torch.randint(2, 95, (1, 48), generator=torch.Generator().manual_seed(1))


def saved(tmp_path, name: str = "h2o"):
    """A file of ``small(name)``'s cache after 40 tokens, and that cache."""
    cache = build_cache(small(name), MODEL)
    stream_logits(MODEL, IDS[:, :40], cache, chunk=7)
    path = tmp_path / f"{name}.safetensors"
    save_cache(cache, path)
    return path, cache


def rewrite(src, dst, change) -> None:
    """Copy the file ``src`` to ``dst`` with ``change(header, tensors)`` applied."""
    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()[HEADER_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(header, tensors)
    save_file(tensors, str(dst), metadata={HEADER_KEY: json.dumps(header)})


def test_a_layer_written_by_other_code_is_refused_naming_file_layer_and_module(tmp_path, monkeypatch):
    path, _ = saved(tmp_path)
    code = json.loads(safe_open(str(path), framework="pt").metadata()[HEADER_KEY])["layers"][0]["code"]
    assert {"kvcompress.selectors.eviction.h2o", "kvcompress.core.layer", "kvcompress.storage.dense"} <= set(
        code
    )
    real = persist_file.module_digest
    edited = lambda name: "f" * 16 if name == "kvcompress.storage.dense" else real(name)  # noqa: E731
    monkeypatch.setattr(persist_file, "module_digest", edited)  # as if dense.py changed since the save
    layer = r"layer 0 \(kvcompress.selectors.eviction.h2o.H2OLayer over kvcompress.storage.dense.DenseStore\)"
    differs = rf"kvcompress.storage.dense \({code['kvcompress.storage.dense']} in the file, f{{16}} here\)"
    with pytest.raises(ValueError, match=rf"h2o.safetensors: {layer} was written by other code: {differs} "
                                         r"differ; save the cache again with this code"):  # fmt: skip
        load_cache(path, MODEL)


def test_a_module_the_file_does_not_list_and_an_old_format_are_refused(tmp_path):
    path, _ = saved(tmp_path)
    bad = tmp_path / "bad.safetensors"
    rewrite(path, bad, lambda h, t: h["layers"][2]["code"].pop("kvcompress.selectors.eviction.h2o"))
    missing = r"layer 2 .* by other code: kvcompress.selectors.eviction.h2o \(not in the file\)"
    with pytest.raises(ValueError, match=missing):
        load_cache(bad, MODEL)

    def version_1(header, tensors):  # what files looked like before they carried code digests
        header.update(version=1)
        header.pop("code"), header.pop("tensors")
        for layer in header["layers"]:
            layer.pop("code")

    rewrite(path, bad, version_1)
    old = r"bad.safetensors is cache file format version 1 \(headers without code digests, last written by "
    with pytest.raises(ValueError, match=rf"{old}kvcompress commit 0a79127\); .* save it again"):
        load_cache(bad, MODEL)


def test_a_file_of_another_format_version_is_refused_naming_both_versions(tmp_path):
    """A header without a version (written before the package move) is refused by its version, never read
    through a table of moved names; so is a version this code does not know."""
    path, _ = saved(tmp_path)
    assert json.loads(safe_open(str(path), framework="pt").metadata()[HEADER_KEY])["version"] == VERSION == 3
    bad = tmp_path / "bad.safetensors"
    rewrite(path, bad, lambda h, t: h.pop("version"))
    before = (
        r"bad.safetensors is cache file format version 2 \(headers without a version, before the package "
        r"move, last written by kvcompress commit fa1acd7\); this kvcompress reads format version 3 only: "
        r"save it again with this code$"
    )
    with pytest.raises(ValueError, match=before):
        load_cache(bad, MODEL)
    rewrite(path, bad, lambda h, t: h.update(version=4))
    later = r"format version 4 \(unknown to this kvcompress\); this kvcompress reads format version 3 only"
    with pytest.raises(ValueError, match=later):
        load_cache(bad, MODEL)


def test_a_module_digest_follows_its_source(tmp_path, monkeypatch):
    (tmp_path / "kvc_digest_probe.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvc_digest_probe", raising=False)
    first = sources.module_digest("kvc_digest_probe")
    (tmp_path / "kvc_digest_probe.py").write_text("X = 2\n")
    assert sources.module_digest("kvc_digest_probe") == first  # read once: the code this process runs
    sources.module_digest.cache_clear()
    assert sources.module_digest("kvc_digest_probe") != first


def test_truncated_and_corrupt_files_are_refused_naming_the_file_and_the_fault(tmp_path):
    path, _ = saved(tmp_path, "quant")
    data, bad = path.read_bytes(), tmp_path / "bad.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"bad.safetensors is truncated or not a safetensors file \("):
        load_cache(bad, MODEL)
    save_file({"x": torch.zeros(1)}, str(bad), metadata={HEADER_KEY: '{"format": '})
    with pytest.raises(ValueError, match=r"bad.safetensors is corrupt: its 'kvcompress' header is not JSON"):
        load_cache(bad, MODEL)
    bad.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one flipped byte in the last tensor's data
    with pytest.raises(ValueError, match=r"bad.safetensors is corrupt: tensor '.+' of layer \d differs"):
        load_cache(bad, MODEL)

    name = "layers.0.store.encoded.keys.0"
    rewrite(path, bad, lambda h, t: t.pop(name))  # the header still names it
    with pytest.raises(ValueError, match=rf"bad.safetensors is corrupt: layer 0 names tensor '{name}', whi"):
        load_cache(bad, MODEL)


def test_each_layer_is_loaded_on_the_device_its_attention_runs_on(tmp_path):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    path, cache = saved(tmp_path, "quant")
    sharded = make_tiny("llama")  # the same weights; accelerate's device_map puts a hook on each block
    add_hook_to_module(sharded.model.layers[1], AlignDevicesHook(execution_device="meta"))
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert placement.layer_devices(sharded, 3) == [cpu, meta, cpu]
    loaded = load_cache(path, sharded)
    on = [{t.device.type for t in held_tensors(layer)} for layer in loaded.layers]
    assert on == [{"cpu"}, {"meta"}, {"cpu"}]
    assert [layer.device for layer in loaded.layers] == [cpu, meta, cpu]
    assert_same_state(cache, load_cache(path, MODEL))  # unsharded: everything back on the CPU, bit for bit


def test_classes_outside_kvcompress_and_its_plugins_are_refused_before_import(tmp_path, monkeypatch):
    runs = "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"  # leaves a mark if imported
    (tmp_path / "kvc_hostile.py").write_text(runs)
    monkeypatch.syspath_prepend(str(tmp_path))
    path, _ = saved(tmp_path)
    bad = tmp_path / "bad.safetensors"
    hostile = {
        "_target_": lambda h: h["policy_config"].update(_target_="kvc_hostile.Policy"),
        "class": lambda h: h["layers"][1].update({"class": "kvc_hostile.Layer"}),
        "store_class": lambda h: h["layers"][0].update(store_class="kvc_hostile.Store"),
        "code": lambda h: h["layers"][0]["code"].update({"kvc_hostile": "0" * 16}),
    }
    for field, change in hostile.items():
        rewrite(path, bad, lambda h, t, change=change: change(h))
        with pytest.raises(ValueError, match=r"'kvc_hostile(\.\w+)?', which is neither a kvcompress class .* "
                                             r"refused \(nothing was imported\)"):  # fmt: skip
            load_cache(bad, MODEL)
        assert "kvc_hostile" not in sys.modules and not (tmp_path / "kvc_hostile.ran").exists(), field
    assert registry.trusted("example_selector.VnormPolicy") and not registry.trusted("os.system")
    plugin, _ = saved(tmp_path, "vnorm")  # a plugin registered through KVCOMPRESS_CONF_PATH still loads
    assert type(load_cache(plugin, MODEL).policy).__module__ == "example_selector"


def test_loading_a_low_rank_cache_runs_no_calibration(tmp_path, monkeypatch):
    path, cache = saved(tmp_path, "low_rank")
    calls = []

    def counted(real):
        return lambda *a, **k: calls.append(real.__name__) or real(*a, **k)

    monkeypatch.setattr(calibration, "calibrate", counted(calibration.calibrate))
    monkeypatch.setattr(calibration, "second_moments", counted(calibration.second_moments))
    loaded = load_cache(path, MODEL)
    assert calls == []
    assert_same_state(cache, loaded)
    more = IDS[:, 40:]
    assert torch.equal(stream_logits(MODEL, more, loaded, 1), stream_logits(MODEL, more, cache, 1))
    assert cache_spans(loaded) == cache_spans(cache) == [{"text": "random", "tokens": [0, 64], "chars": None}]
    assert loaded.stats()[0]["calibration_source"] == "cache file"
    with pytest.raises(RuntimeError, match="its bases came from a cache file; build_cache"):
        loaded.policy.storage.layer(0, model_spec(MODEL))  # no placeholder basis outlives the load
    again = build_cache(loaded.policy, MODEL)  # a new cache of the loaded policy is calibrated as usual
    assert calls == ["calibrate"] and again.stats()[0]["key_components"] == cache.stats()[0]["key_components"]


@pytest.mark.parametrize(
    "name,params",
    [("tova", {}), ("keydiff", {"unit": "chunk", "chunk_size": 4}), ("snapkv", {})],
)
def test_what_a_layer_reads_off_its_policy_is_rebuilt_not_saved(tmp_path, name, params):
    """``reads_as_stored``, ``observed_probs``, ``order_free`` and ``decode_evicts`` follow from the policy
    when the layer is built: a file does not carry them, and a loaded layer has the built layer's values."""
    derived = ("reads_as_stored", "observed_probs", "order_free", "decode_evicts")
    cache = build_cache(name, MODEL, **params)
    stream_logits(MODEL, IDS, cache, chunk=48)
    save_cache(cache, tmp_path / "c.kvc")
    with safe_open(str(tmp_path / "c.kvc"), "pt") as f:
        header = json.loads(f.metadata()[HEADER_KEY])
    assert not set(derived) & set(json.dumps(header["layers"][0]["state"]).split('"')[1::2])
    loaded = load_cache(tmp_path / "c.kvc", MODEL)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert [getattr(a, n) for n in derived] == [getattr(b, n) for n in derived]
