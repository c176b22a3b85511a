"""Prepared weights (engine/prepared_weights.py, kernels/cpu/onednn_bytes.py): a CPU model loaded from
the file its first load kept holds the same parameters and packed weights, bit for bit, and computes
the same logits bit for bit; the file is used in place (mapped, not copied), a changed checkpoint or
a damaged file is a miss, and an in-place reload leaves the file as it was."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.paged_helpers import PagedKV, run_step
from tokenmill.engine import disk_cache, prepared_weights
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.kernels.cpu import gemm, onednn_bytes
from tokenmill.kernels.cpu.paths import CpuPaths
from tokenmill.tools.smollm2 import cached_smollm2, unavailable_reason
from tokenmill.tools.tiny_models import cached_tiny_model

ONEDNN_LAYERS = CpuPaths(onednn_linear=True, onednn_layers=True)  # every projection packed, on a tiny model
PROMPTS = [("a", list(range(3, 40))), ("b", [5, 9, 11, 4, 100, 7]), ("c", [42] * 19)]


@pytest.fixture(scope="session")
def folders():
    """The checkpoints, from the usual cache (before a test points TOKENMILL_CACHE elsewhere)."""
    found = {name: cached_tiny_model(name) for name in ("test-llama", "test-qwen2", "test-qwen3", "tiny-llama")}
    if not unavailable_reason():
        found["smollm2"] = cached_smollm2()
    return found


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch, folders):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))


def load(path, cpu_paths=None):
    return load_model(path, attention_backend=TorchAttentionBackend(), cpu_paths=cpu_paths)


def entries():
    return sorted((disk_cache.cache_root() / prepared_weights.KIND).glob("*.bin"))


def logits(model, cfg):
    kv = PagedKV.for_model(cfg)
    first = model.compute_logits(run_step(model, kv, PROMPTS)[0])
    second = model.compute_logits(run_step(model, kv, [(sid, [7]) for sid, _ in PROMPTS])[0])  # a decode step
    return torch.cat([first, second])


def packed_bytes(model):
    return {name: bytes(onednn_bytes.data(w)) for name, w in model.onednn_packed().items()}


def test_packed_weights_come_back_from_their_bytes_bit_for_bit():
    assert onednn_bytes.available() == gemm.available()
    if not gemm.available():
        return
    gen = torch.Generator().manual_seed(3)
    for shape in ((960, 576), (576, 1536), (3072, 576), (1000, 64)):
        weight = torch.randn(*shape, generator=gen)
        packed = gemm.pack(weight)
        memory = torch.frombuffer(bytearray(onednn_bytes.data(packed)), dtype=torch.uint8)
        again = onednn_bytes.from_bytes(onednn_bytes.descriptor(packed), memory, shape)
        assert again.shape == packed.shape and bytes(onednn_bytes.data(again)) == bytes(onednn_bytes.data(packed))
        for rows in (1, 5, 37, 300):
            x = torch.randn(rows, shape[1], generator=gen)
            assert torch.equal(gemm.linear(x, weight, None, packed), gemm.linear(x, weight, None, again))
    with pytest.raises(RuntimeError, match="does not describe"):
        onednn_bytes.from_bytes(onednn_bytes.descriptor(packed), memory[:-64], shape)


@pytest.mark.parametrize("model", ["test-llama", "test-qwen2", "test-qwen3", "tiny-llama"])
@pytest.mark.parametrize("paths", [None, ONEDNN_LAYERS], ids=["default-paths", "onednn-layers"])
def test_a_model_from_its_prepared_file_is_the_checkpoint_model(folders, model, paths):
    folder = folders[model]
    first, cfg = load(folder, paths)
    assert len(entries()) == 1
    second, _ = load(folder, paths)
    ours, theirs = dict(second.named_parameters()), dict(first.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    assert packed_bytes(second) == packed_bytes(first)
    if paths is ONEDNN_LAYERS and gemm.available():
        assert len(packed_bytes(second)) == 1 + 4 * cfg.num_layers
    assert torch.equal(logits(second, cfg), logits(first, cfg))
    assert len(entries()) == 1


def test_the_prepared_file_is_used_in_place(folders):
    folder = folders["tiny-llama"]
    load(folder, ONEDNN_LAYERS)
    model, _ = load(folder, ONEDNN_LAYERS)
    [entry] = entries()
    size = entry.stat().st_size
    for name, param in model.named_parameters():
        storage = param.untyped_storage()
        assert storage.nbytes() == size, name  # a view of the whole mapped file, not a copy
        assert param.data_ptr() % prepared_weights.ALIGN == 0, name
    maps = open("/proc/self/maps").read()
    assert str(entry) in maps


def test_a_changed_checkpoint_is_loaded_again(folders, tmp_path):
    folder = shutil.copytree(folders["test-qwen2"], tmp_path / "ckpt")
    before, cfg = load(folder)
    tensors = dict(before.named_parameters())
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    after, _ = load(folder)
    assert torch.equal(dict(after.named_parameters())["norm"], tensors["norm"] * 2)
    again, _ = load(folder)
    assert torch.equal(logits(again, cfg), logits(after, cfg))
    assert len(entries()) == 2  # one per key; the older goes when the cache holds more than it keeps


def test_a_damaged_file_is_a_miss(folders):
    folder = folders["test-llama"]
    first, cfg = load(folder)
    [entry] = entries()
    with open(entry, "r+b") as f:
        f.truncate(entry.stat().st_size - 4096)
    second, _ = load(folder)  # loaded from the checkpoint (and the file written again)
    assert torch.equal(logits(second, cfg), logits(first, cfg))
    assert entry.stat().st_size > 0 and prepared_weights.load(folder, _key_of(folder, second)) is not None


def _key_of(folder, model):
    from tokenmill.engine import loader
    from tokenmill.engine.checkpoint_files import weight_files

    return loader._prepared_key(folder, weight_files(folder), model)


def test_an_in_place_reload_leaves_the_file_as_it_was(folders):
    folder = folders["test-llama"]
    reference, cfg = load(folder, ONEDNN_LAYERS)
    original = reference.embed_tokens.detach().clone()
    model, _ = load(folder, ONEDNN_LAYERS)
    [entry] = entries()
    before = entry.read_bytes()
    with torch.no_grad():
        for m in (model, reference):
            for layer in m.layers:
                layer.gate_up_weight.mul_(0.5)  # a reload written in place
            m.embed_tokens.add_(0.01)
    assert torch.equal(logits(model, cfg), logits(reference, cfg))  # the packed weights followed
    assert entry.read_bytes() == before
    assert torch.equal(load(folder, ONEDNN_LAYERS)[0].embed_tokens, original)


def test_an_unwritable_cache_only_costs_the_next_start(folders, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("TOKENMILL_CACHE", str(blocker))
    model, cfg = load(folders["test-llama"])
    assert logits(model, cfg).isfinite().all()
    assert not os.path.isdir(blocker)


@pytest.mark.slow
def test_smollm2_from_its_prepared_file_is_the_checkpoint_model(folders):
    if "smollm2" not in folders:
        pytest.skip(unavailable_reason())
    folder = folders["smollm2"]
    first, cfg = load(folder)
    second, _ = load(folder)
    assert packed_bytes(second) == packed_bytes(first)
    assert torch.equal(logits(second, cfg), logits(first, cfg))
