"""Published numbers: every table of README.md and experiments/README.md is rendered from an experiment record,
every record has its table in experiments/README.md, every experiment file pins a complete, valid recipe, and
each record says how it was made."""
from __future__ import annotations

import json

import pytest
from pydantic import Field

import specdistill.recipe as recipe_module
from experiments import render, schema, tables
from specdistill.errors import SpecdistillError
from specdistill.recipe import recipe_dump


@pytest.mark.parametrize("name", schema.names())
def test_experiment_file_validates_and_matches_its_record(name):
    exp = schema.load(name)  # fields, a complete recipe, every arm through the recipe loader
    record = render.read_record(name)
    assert record["experiment"] == name and record["command"] == exp.command
    assert record["table"]["columns"] == exp.columns
    assert record["provenance"].startswith(("run by", "recorded from", "transcribed from"))
    assert record["settings"] == {arm: schema.settings_as_recorded(exp, arm, record["settings"].get(arm))
                                  for arm in exp.arms}, \
        f"experiments/{name}.yaml changed since its record was written: rerun it or transcribe again"


def test_every_readme_table_is_its_records():
    assert render.problems() == []
    assert {p.stem for p in schema.RECORDS.glob("*.json")} == set(schema.names())


def first_rendered_row(text: str) -> tuple[str, str]:
    """The first block of a document and the first data row of its table (under the header and the rule)."""
    block = next(render.BLOCK.finditer(text))
    return block["name"], block["body"].splitlines()[2]


@pytest.mark.parametrize("document", ["README.md", "experiments/README.md"])
def test_a_hand_edited_table_number_is_caught(document):
    """A row of any rendered table, edited by hand, is named with the record it differs from (in either file)."""
    readme, experiments_readme = render.README.read_text(), render.EXPERIMENTS_README.read_text()
    text = readme if document == "README.md" else experiments_readme
    name, row = first_rendered_row(text)
    edited_row = row[:-len(" |")] + " (edited by hand) |"
    edited = text.replace(row, edited_row, 1)
    assert edited != text
    args = (edited, experiments_readme) if document == "README.md" else (readme, edited)
    (problem,) = render.problems(*args)
    assert problem.startswith(f"{document} table {name} differs") and "(edited by hand)" in problem


def test_a_record_without_a_table_in_experiments_readme_is_caught():
    """Every record has its table in experiments/README.md; the headline in README.md does not count for it."""
    experiments_readme = render.EXPERIMENTS_README.read_text()
    block = next(render.BLOCK.finditer(experiments_readme))
    name = block["name"]
    readme_with_it = f"{render.README.read_text()}\n{block[0]}"
    assert render.problems(readme_with_it, experiments_readme) == []
    (problem,) = render.problems(readme_with_it, experiments_readme.replace(block[0], "", 1))
    assert problem == (f"experiments/records/{name}.json has no table in experiments/README.md "
                       f"(<!-- experiment: {name} -->)")


def test_an_unpinned_or_unknown_key_is_caught(tmp_path, monkeypatch):
    exp = schema.load("objective")
    monkeypatch.setattr(schema, "EXPERIMENTS", tmp_path)
    for change, message in ((lambda r: r["train"].pop("lr"), "does not pin train.lr"),
                            (lambda r: r["eval"].update(runtme="static-bf16"), "unknown key 'eval.runtme'")):
        recipe = json.loads(json.dumps(exp.recipe))
        change(recipe)
        (tmp_path / "objective.yaml").write_text(json.dumps({**exp.model_dump(), "recipe": recipe}))
        with pytest.raises(SpecdistillError, match=message):
            schema.load("objective")


@pytest.fixture
def schema_with_a_new_key(monkeypatch):
    """The recipe schema with a key added since every record was written (`eval.added_later`, default 7)."""
    class Eval(recipe_module.EvalConfig):
        added_later: int = 7

    class Recipe(recipe_module.Recipe):
        eval: Eval = Field(default_factory=Eval)

    monkeypatch.setattr(recipe_module, "Recipe", Recipe)
    return "eval.added_later"


def test_a_key_added_to_the_schema_after_the_record_needs_no_edit(schema_with_a_new_key):
    """Every experiment file still loads (the key is newer than its record), each arm runs the key's default,
    and each file still matches its record."""
    for name in schema.names():
        exp = schema.load(name)
        record = render.read_record(name)["settings"]
        for arm in exp.arms:
            assert schema.pinned_recipe(exp, arm).eval.added_later == 7
            assert schema_with_a_new_key in schema.newer_than_record(exp, arm, record[arm])
            assert schema.settings_as_recorded(exp, arm, record[arm]) == record[arm]
            assert recipe_dump(schema.pinned_recipe(exp, arm)) != record[arm]  # the full recipe has the key


def test_a_key_the_record_pinned_is_refused_when_the_file_drops_it(schema_with_a_new_key, tmp_path, monkeypatch):
    """The new key is let through, a key the record has is not (train.lr dropped from the file), and without a
    record every key must be pinned, the new one too."""
    exp = schema.load("objective")
    monkeypatch.setattr(schema, "EXPERIMENTS", tmp_path)
    recipe = json.loads(json.dumps(exp.recipe))
    recipe["train"].pop("lr")
    (tmp_path / "objective.yaml").write_text(json.dumps({**exp.model_dump(), "recipe": recipe}))
    with pytest.raises(SpecdistillError, match=r"does not pin train\.lr \("):  # the new key is not named
        schema.load("objective")
    (tmp_path / "objective.yaml").write_text(json.dumps(exp.model_dump()))
    assert schema.load("objective") == exp
    monkeypatch.setattr(schema, "RECORDS", tmp_path)  # no record: nothing is newer than it
    with pytest.raises(SpecdistillError, match=r"does not pin .*eval\.added_later"):
        schema.load("objective")


def test_exactness_record_table_is_its_results():
    """The one record re-run here: its table is what its results say (nothing edited by hand in between)."""
    record = render.read_record("exactness")
    for row, (arm, check) in zip(record["table"]["rows"], record["results"].items()):
        assert row[0] == f"`{arm}`"
        assert row[1:-1] == ["yes" if c["bitwise_identical"] else "**no**" for c in check["checks"]]
    assert record["hardware"]["cpu"] and record["code_version"]


@pytest.mark.parametrize("name", sorted(tables.ROWS))
def test_a_computed_table_is_its_results(name):
    """A pipeline table computed from raw results (experiments/tables.py) says what those results say."""
    record = render.read_record(name)
    if record["provenance"].startswith("transcribed"):  # a transcribed table has no raw results to compute it from
        pytest.skip(f"{name}: transcribed, not yet rerun ({record['provenance']})")
    assert record["table"]["rows"] == tables.ROWS[name](record["results"])


def test_a_changed_result_changes_the_computed_table():
    """The table follows the record's results: a measured τ moved by 0.5 in the results moves it in the table
    (a formatter printing a constant, or reading the wrong field, would leave the stored table unchanged)."""
    record = render.read_record("medusa-vs-eagle3")
    assert record["table"]["rows"] == tables.ROWS["medusa-vs-eagle3"](record["results"])
    arm = next(iter(record["results"].values()))
    t0 = next(r for r in tables.last_eval(arm)["results"] if r["temperature"] == 0.0)
    t0["tau"] += 0.5
    assert record["table"]["rows"] != tables.ROWS["medusa-vs-eagle3"](record["results"])


def test_a_command_that_does_not_run_the_pinned_settings_is_refused(tmp_path, monkeypatch):
    exp = schema.load("runtime-bench")
    monkeypatch.setattr(schema, "EXPERIMENTS", tmp_path)
    for change, message in (({"command": "make bench ARGS=runtime"}, "command must be"),
                            ({"bench": None}, "bench names the benchmark")):
        (tmp_path / "runtime-bench.yaml").write_text(json.dumps({**exp.model_dump(), **change}))
        with pytest.raises(SpecdistillError, match=message):
            schema.load("runtime-bench")


def test_replan_refits_a_recorded_plan_to_its_own_sizes():
    """experiments/replan.py on the AVX2 default record, nothing added: the plan's fit on the record's measured rates
    gives the sizes the run had (so a refit with an override is the estimate that change would have made there)."""
    from experiments.replan import replan

    plan = json.loads((schema.RECORDS / "default-90min-avx2.json").read_text())["results"]["main"]["plan"]
    recorded = {k: int(v) for k, v in (o.split("=") for o in plan["overrides"]) if k in ("corpus.max_rows",
                                                                                          "train.max_steps")}
    got = replan("default-90min-avx2", [])
    assert {k: got[k] for k in recorded} == recorded
    assert replan("default-90min-avx2", ["train.save_every=224"])["train.max_steps"] > recorded["train.max_steps"]
