"""`make bench ARGS=peer`'s own parts: our cache in speculators' offline format (benchmarks/peer_format.py) and
the one line that says how to install speculators where it is missing. (The whole bench at toy size, with
speculators' trainer, is tests/test_benchmarks.py::test_peer_bench_at_toy_size.)"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks import peer_bench
from benchmarks.peer_format import split_ratio, write_offline_data
from specdistill import layout
from specdistill.data.cache_reader import CacheDataset
from specdistill.errors import SpecdistillError
from tests.test_eagle3 import add_aux_states
from tests.test_train import write_cache


def verifier_norm(weight: torch.Tensor, eps: float = 1e-5):
    """The norm speculators' trainer applies to the last state it reads (its verifier_norm, Llama's RMSNorm)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(weight.shape[0], eps=eps)
    norm.weight.data.copy_(weight)
    return norm


def test_offline_data_holds_our_cache_as_speculators_reads_it(tmp_path, smollm_tokenizer):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from specdistill.target import read_target_tensors
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    with torch.no_grad():  # a final norm that is not all ones, so that un-norming the last state matters
        model.model.norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5)
        model.model.embed_tokens.weight.mul_(50)  # states of a trained target's size: mean square >> the norm's eps
    model.save_pretrained(tmp_path / "target")
    run_dir = tmp_path / "run"
    write_cache(run_dir, tmp_path / "target", n_train=5, n_heldout=2)
    add_aux_states(run_dir, tmp_path / "target", [0, 1, 2])
    weight = read_target_tensors(tmp_path / "target", ["model.norm.weight"])["model.norm.weight"]
    summary = write_offline_data(layout.cache_dir(run_dir), tmp_path / "data", weight)
    assert summary["rows"] == {"train": 5, "heldout": 2}
    assert int(7 * summary["train_data_ratio"]) == 5  # its split keeps exactly our train rows for training
    rows = load_from_disk(str(tmp_path / "data"))
    assert len(rows) == 7 and {"input_ids", "loss_mask", "seq_len"} <= set(rows.column_names)
    norm = verifier_norm(weight, model.config.rms_norm_eps)  # its verifier norm takes the target's eps
    for row, (split, i) in enumerate([("train", i) for i in range(5)] + [("heldout", i) for i in range(2)]):
        item = CacheDataset(layout.cache_dir(run_dir), split)[i]
        hs = load_file(str(tmp_path / "data" / "hidden_states" / f"hs_{row}.safetensors"))
        assert torch.equal(hs["token_ids"], item["input_ids"]) and torch.equal(rows[row]["input_ids"], item["input_ids"])
        assert torch.equal(rows[row]["loss_mask"], item["loss_mask"].long()) and rows[row]["seq_len"] == len(item["input_ids"])
        assert torch.equal(hs["hidden_states"][:, :-1], item["hidden_aux"])  # the aux layers, in order
        with torch.no_grad():  # what its trainer computes from the last slot: our hidden_last (the final-norm output)
            torch.testing.assert_close(norm(hs["hidden_states"][:, -1]), item["hidden_last"], atol=1e-4, rtol=1e-4)


def test_offline_data_refuses_what_it_cannot_convert(tmp_path, tiny_target_dir, monkeypatch):
    from collections import namedtuple

    from benchmarks import peer_format

    run_dir = tmp_path / "run"
    write_cache(run_dir, tiny_target_dir, n_train=2, n_heldout=1)
    with pytest.raises(SpecdistillError, match="train split has no hidden_aux"):  # an EAGLE-1 cache
        write_offline_data(layout.cache_dir(run_dir), tmp_path / "data", torch.ones(64))
    weight = torch.ones(64)
    weight[3] = 0
    with pytest.raises(SpecdistillError, match="final norm has zero weights"):
        write_offline_data(layout.cache_dir(run_dir), tmp_path / "data2", weight)
    add_aux_states(run_dir, tiny_target_dir, [0, 1, 2])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(peer_format.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(SpecdistillError, match=r"needs 0\.0 GiB, the disk has 0\.0 GiB free"):
        write_offline_data(layout.cache_dir(run_dir), tmp_path / "data3", torch.ones(64))
    assert not list((tmp_path / "data3").glob("hidden_states/*"))  # stopped before writing anything


def test_split_ratio_is_exact_for_every_size():
    for total in range(2, 300):
        for train in range(1, total):
            assert int(total * split_ratio(train, total)) == train


@pytest.mark.skipif(importlib.util.find_spec("speculators") is not None, reason="speculators is importable here")
def test_missing_speculators_says_how_to_install_it_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peer_bench.PEER_SITE_ENV, str(tmp_path / "site"))
    reason = peer_bench.missing_peer()
    assert f"pip install --target {tmp_path / 'site'} --no-deps speculators==0.9.0" in reason
    assert peer_bench.PEER_SITE_ENV in reason and "speculators" in reason.split("missing")[1]
    peer_bench.main(["--toy"])  # says so and stops, before any stage runs
    assert capsys.readouterr().out.strip() == reason
