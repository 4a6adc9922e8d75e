import pytest

from specdistill.errors import SpecdistillError
from specdistill.recipe import load_recipe

DEFAULT = "recipes/smollm2-135m-eagle.yaml"


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


MINIMAL = """
target: {path: some/dir}
corpus: {path: data.jsonl}
draft: {kind: eagle}
train: {max_steps: 10, save_every: 5}
"""


def test_default_recipe_loads_and_names_run_after_file():
    r = load_recipe(DEFAULT)
    assert r.run_name == "smollm2-135m-eagle"
    assert r.run_dir.name == "smollm2-135m-eagle"
    assert r.draft.kind == "eagle"
    assert r.temperatures == [0.0, 1.0]


def test_overrides_apply_with_yaml_values(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL), ["train.max_steps=50", "eval.temperature=[0, 0.7]",
                                               "corpus.columns={user: question, assistant: answer}",
                                               "train.lr=1e-3", "run_name=exp1"])
    assert r.train.max_steps == 50
    assert r.temperatures == [0.0, 0.7]
    assert r.corpus.columns == {"user": "question", "assistant": "answer"}
    assert r.train.lr == pytest.approx(1e-3)
    assert r.run_name == "exp1"


@pytest.mark.parametrize("extra, message", [
    ("train: {max_steps: 10, save_every: 5, max_step: 3}", "unknown key 'train.max_step'"),
    ("train: {max_steps: ten, save_every: 5}", "key 'train.max_steps'"),
    ("train: {save_every: 5}", "missing required key 'train.max_steps'"),
    ("draft: {kind: lookahead}", "key 'draft.kind'"),  # a kind not implemented
    ("draft: {kind: medusa, ttt_steps: 3}", "unknown key 'draft.ttt_steps'"),  # an EAGLE-3 key
    ("draft: {kind: eagle, ttt_steps: 3}", "unknown key 'draft.ttt_steps'"),  # an EAGLE-3 key
    ("draft: {kind: eagle3, num_layers: 2}", "unknown key 'draft.num_layers'"),  # a draft-LM key
    ("eval: {tree: {kind: dynamic, depth: 3, top_k: 2}}", "missing required key 'eval.tree.total_tokens'"),
    ("eval: {tree: {paths: [[0], [1, 1]]}}", "key 'eval.tree': Value error, paths: [1, 1] has no parent path [1]"),
    ("eval: {tree: {kind: bushy, depth: 2}}", "key 'eval.tree.kind'"),
    ("bogus: {a: 1}", "unknown key 'bogus'"),
])
def test_bad_recipes_name_file_and_key(tmp_path, extra, message):
    base = {line.split(":")[0]: line for line in MINIMAL.strip().splitlines()}
    base[extra.split(":")[0]] = extra
    p = write(tmp_path, "\n".join(base.values()))
    with pytest.raises(SpecdistillError) as e:
        load_recipe(p)
    assert str(p) in str(e.value) and message in str(e.value)


def test_missing_draft_section(tmp_path):
    p = write(tmp_path, "\n".join(l for l in MINIMAL.splitlines() if not l.startswith("draft")))
    with pytest.raises(SpecdistillError, match="missing required key 'draft'"):
        load_recipe(p)


def test_bad_override_key(tmp_path):
    with pytest.raises(SpecdistillError, match="unknown key 'train.nope'"):
        load_recipe(write(tmp_path, MINIMAL), ["train.nope=1"])
    with pytest.raises(SpecdistillError, match="expected section.key=value"):
        load_recipe(write(tmp_path, MINIMAL), ["train.max_steps"])


def test_missing_recipe_file(tmp_path):
    with pytest.raises(SpecdistillError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_prints_one_line_error(tmp_path, capsys):
    from specdistill.cli import main

    p = write(tmp_path, MINIMAL.replace("max_steps: 10", "max_steps: 10, typo: 1"))
    assert main(["prepare", "--recipe", str(p)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'train.typo'" in err and "Traceback" not in err


def test_kind_specific_loss_keys_belong_to_their_kind(tmp_path):
    """A kind's loss keys (kinds/<kind>/config.py Loss) are valid for it and refused, by name, for another kind."""
    eagle3 = load_recipe(write(tmp_path, MINIMAL.replace("kind: eagle", "kind: eagle3")), ["loss.ttt_decay=0.5"])
    assert eagle3.loss.ttt_decay == 0.5 and eagle3.loss.terms == {"fkl": 1.0}
    assert "kind" not in eagle3.model_dump()["loss"]  # the tag the recipe adds is not a key of the section
    assert load_recipe(write(tmp_path, MINIMAL)).loss.feature_weight == 1.0  # EAGLE-1's defaults
    for kind, key in (("draft_lm", "loss.ttt_decay=0.5"), ("eagle", "loss.ttt_decay=0.5"),
                      ("draft_lm", "loss.feature_noise=0.1"), ("eagle3", "loss.distribution_sample=0.5")):
        path = write(tmp_path, MINIMAL.replace("kind: eagle", f"kind: {kind}"))
        with pytest.raises(SpecdistillError) as e:
            load_recipe(path, [key])
        assert str(e.value) == f"{path}: unknown key '{key.split('=')[0]}'"
