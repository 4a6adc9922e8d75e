"""The cache pass over a target spread with device_map="auto" (data/cache.py target_outputs).

This machine has one device (a CPU build of torch cannot make, or even fake, a second CUDA or privateuse1
device), so a genuine split cannot run here. The test runs the real tiny target's forward, then gives each
output the device accelerate's dispatch would leave it on, as a label on a CPU tensor: an op mixing labels
raises as CUDA does. What it shows: target_outputs moves each hidden state before masking and stacking, and
stores the same values, bit for bit, as on one device; compute_shard, over several padded batches, returns the
one-device shard bit for bit, in float32 and in bfloat16."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from specdistill.data import target_pass
from specdistill.data.target_pass import compute_shard, real_rows, target_outputs
from tests.conftest import tiny_model

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


class Placed(torch.Tensor):
    """A CPU tensor labelled with the device it would live on: `.to(device)` moves the label, other ops
    require one label over their tensor arguments (as CUDA requires one device) and keep it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, where):
        t = torch.Tensor._make_subclass(cls, data)
        t.where = torch.device(where)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return args[0].where
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.cpu:
                return Placed(args[0].clone(), "cpu")
            if func is torch.Tensor.to:
                to = [a for a in [*args[1:], kwargs.get("device")] if isinstance(a, (str, torch.device))]
                dtype = [a for a in [*args[1:], kwargs.get("dtype")] if isinstance(a, torch.dtype)]
                data = args[0].to(dtype[0]) if dtype else args[0].clone()
                return Placed(data, to[0] if to else args[0].where)
            labels = {a.where for a in tree_flatten((args, kwargs))[0] if isinstance(a, Placed)}
            if len(labels) > 1:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found {sorted(map(str, labels))}")
            out = func(*args, **kwargs)
        where = labels.pop()
        return tree_map(lambda o: Placed(o, where) if type(o) is torch.Tensor else o, out)


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


class SpreadTarget:
    """The tiny target as accelerate leaves a two-GPU dispatch: the embedding and the first layers on cuda:0,
    the rest, the final norm and the LM head on cuda:1; hidden_states[i] where layer i-1 ran."""

    def __init__(self, model, first_on_gpu1: int):
        self.model, self.config, self.first_on_gpu1 = model, model.config, first_on_gpu1

    def get_decoder(self):
        def forward(**kw):
            kw = {k: plain(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            out = self.model.get_decoder()(**kw)
            if out.hidden_states is not None:
                out.hidden_states = tuple(Placed(h, GPU1 if i > self.first_on_gpu1 else GPU0)
                                          for i, h in enumerate(out.hidden_states))
            out.last_hidden_state = Placed(out.last_hidden_state, GPU1)
            return out
        return forward

    def get_input_embeddings(self):
        return SimpleNamespace(weight=Placed(self.model.get_input_embeddings().weight, GPU0))

    def get_output_embeddings(self):
        head = self.model.get_output_embeddings()
        return lambda hidden: Placed(head(plain(hidden.to(GPU1))), GPU1)  # accelerate's hook moves the input


@pytest.fixture(scope="module")
def batch():
    ids = torch.tensor([[5, 9, 13, 21, 34, 55], [7, 11, 17, 0, 0, 0]], device="cpu")
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], device="cpu")
    return ids, mask


STORE = ["hidden_aux", "hidden_last", "topk"]


def test_a_spread_target_stores_what_one_device_stores_bit_for_bit(batch):
    model = tiny_model("llama", vocab_size=256, layers=4)
    ids, mask = batch
    one = target_outputs(model, ids, mask, STORE, [1, 2, 4], 4, torch.float32)
    spread = target_outputs(SpreadTarget(model, first_on_gpu1=2), Placed(ids, GPU0), Placed(mask, GPU0),
                            STORE, [1, 2, 4], 4, torch.float32)
    assert spread.keys() == one.keys()
    for name, tensor in one.items():
        assert torch.equal(plain(spread[name]), tensor), name
    assert spread["hidden_aux"].device == GPU0 and spread["hidden_last"].device == GPU1
    assert spread["hidden_aux"].shape == (9, 3, 64)


SEQUENCES = [[5, 9, 13, 21, 34, 55, 89], [7, 11, 17], [2, 3, 5, 7, 11], [101, 102], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_spread_target_writes_the_one_device_shard_bit_for_bit(monkeypatch, dtype):
    """compute_shard, the cache stage's own function, over several padded batches: the shard of the spread target
    equals the one-device shard bit for bit, in float32 and in bfloat16 (target and stored kinds). Here both run
    the same CPU kernels, so the split can change nothing but where tensors live; on real GPUs each layer runs the
    same kernels on another GPU of the same kind and the moves between them are exact copies, so bf16 is expected
    bit for bit there too (not shown here)."""
    from datasets import Dataset

    model = tiny_model("llama", vocab_size=256, layers=4).to(getattr(torch, dtype))
    split_ds = Dataset.from_dict({"input_ids": SEQUENCES, "loss_mask": [[1] * len(s) for s in SEQUENCES]})
    lengths = [len(s) for s in SEQUENCES]
    settings = {"store": STORE, "aux_layers": [1, 2, 4], "topk": 4, "dtype": dtype, "batch_tokens": 16}
    one = compute_shard(model, split_ds, range(len(SEQUENCES)), lengths, settings)
    real_pad = target_pass.pad_batch  # built on the host, then labelled with the first GPU as `.to(cuda:0)` would
    monkeypatch.setattr(target_pass, "pad_batch", lambda seqs, device: tuple(
        Placed(t, device) for t in real_pad(seqs, "cpu")))
    spread = compute_shard(SpreadTarget(model, first_on_gpu1=2), split_ds, range(len(SEQUENCES)), lengths, settings)
    assert len(target_pass.plan_batches(range(len(SEQUENCES)), lengths, 16)) >= 3  # several batches, padded
    assert spread.keys() == one.keys() and {"hidden_aux", "hidden_last", "topk_ids"} <= one.keys()
    for name, tensor in one.items():
        got = plain(spread[name])
        assert got.dtype == tensor.dtype and got.device == tensor.device and torch.equal(got, tensor), name
    assert one["hidden_aux"].dtype == getattr(torch, dtype)


def test_real_rows_masks_where_the_state_lives():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32, device="cpu").reshape(2, 3, 2)
    valid = torch.tensor([[True, True, False], [True, False, False]], device="cpu")
    rows = real_rows(Placed(hidden, GPU1), Placed(valid, GPU0), GPU0)
    assert rows.device == GPU0 and torch.equal(plain(rows), hidden[valid])
    with pytest.raises(RuntimeError, match="same device"):  # what the pass did before: mask and state apart
        Placed(hidden, GPU1)[Placed(valid, GPU0)]
