"""The names of the target's runtimes (`eval.runtime`: `<family>-<dtype>` or `auto`) and which one `auto`
resolves to for a target's config; torch-free, so the report resolves a recipe's runtime without torch.
The runtimes themselves are eval/runtime.py's."""
from __future__ import annotations

from specdistill.errors import SpecdistillError

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # target.DTYPES' names, short
STATIC_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
FAMILIES = ("eager", "static", "compiled")


def runtime_name(family: str, dtype: str) -> str:
    return f"{family}-{SHORT_DTYPE[dtype]}"


def parse_runtime(name: str) -> tuple[str, str]:
    """'static-bf16' -> ('static', 'bfloat16')."""
    long = {short: dtype for dtype, short in SHORT_DTYPE.items()}
    family, _, dt = name.partition("-")
    if family not in FAMILIES or dt not in long:
        raise SpecdistillError(f"eval.runtime {name!r}: expected one of "
                               f"{', '.join(f + '-' + d for f in FAMILIES for d in long)}")
    return family, long[dt]


def resolve_runtime_name(name: str, config) -> str:
    """`auto`: the static runtime in bf16 where it supports the architecture (the fastest exact runtime
    measured by `make bench ARGS=runtime`), else transformers' forward in bf16."""
    if name != "auto":
        parse_runtime(name)
        return name
    return "static-bf16" if static_supports(config) else "eager-bf16"


def static_supports(config) -> bool:
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return getattr(config, "model_type", None) in STATIC_MODEL_TYPES and not sliding
