"""What benchmarks/gpu_wheels.sh carries to the GPU machine, read from the script itself, and a check of the
.whl/ folder it writes (`python -m benchmarks.gpu_wheels .whl`, the script's last step; tests/test_gpu_check.py).

The script's arrays are the one list: BINARY (downloaded wheels, name==version), DEEPSPEED (built from its
sdist) and ON_IMAGE (what the lent machine's image already holds, by its device notes: not carried)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu_wheels.sh"
MAX_MIB = 64  # what a device call carries in all
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]  # the script's --platform list: the lent machine is CPython 3.12, x86-64


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def bash_array(text: str, name: str) -> list[str]:
    """The words of `NAME=( ... )` in a bash script, comments dropped."""
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # no pin holds a '#'
    found = re.search(rf"^{name}=\((.*?)\)", code, re.S | re.M)
    if not found:
        raise ValueError(f"{SCRIPT.name}: no {name}=( ... ) array")
    return found.group(1).split()


def pins(text: str | None = None) -> dict[str, str]:
    """Every carried wheel, canonical name -> version (BINARY and DEEPSPEED)."""
    text = SCRIPT.read_text() if text is None else text
    out = {}
    for word in bash_array(text, "BINARY") + bash_array(text, "DEEPSPEED"):
        name, sep, version = word.partition("==")
        if not sep or not version:
            raise ValueError(f"{SCRIPT.name}: {word!r} is not pinned as name==version")
        out[canonical(name)] = version
    return out


def on_image(text: str | None = None) -> set[str]:
    return {canonical(w) for w in bash_array(SCRIPT.read_text() if text is None else text, "ON_IMAGE")}


def _compatible_tags() -> set:
    from packaging import tags

    return set(tags.cpython_tags((3, 12), platforms=PLATFORMS)) | set(
        tags.compatible_tags((3, 12), "cp312", platforms=PLATFORMS))


def check_dir(folder: Path, wanted: dict[str, str] | None = None) -> list[str]:
    """What is wrong with a built .whl/ folder (empty when nothing): a wheel per pin at its version installable
    by CPython 3.12 on x86-64 Linux, no other wheel, the tokenizer's files, at most MAX_MIB in all."""
    from packaging.utils import parse_wheel_filename

    wanted = pins() if wanted is None else wanted
    problems, seen, ok_tags = [], {}, _compatible_tags()
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
        seen.setdefault(canonical(name), []).append(str(version))
        if canonical(name) not in wanted:
            problems.append(f"{wheel.name}: not in the script's list")
        elif str(version) != wanted[canonical(name)]:
            problems.append(f"{wheel.name}: version {version}, the script pins {wanted[canonical(name)]}")
        if not set(wheel_tags) & ok_tags:
            problems.append(f"{wheel.name}: not installable by CPython 3.12 on manylinux x86-64")
    for name in sorted(set(wanted) - set(seen)):
        problems.append(f"{name}=={wanted[name]}: no wheel")
    problems += [f"{name}: {len(v)} wheels ({', '.join(v)})" for name, v in sorted(seen.items()) if len(v) > 1]
    tok = folder / "smollm2-tokenizer"
    problems += [f"smollm2-tokenizer/{f}: missing" for f in TOKENIZER_FILES if not (tok / f).is_file()]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if size > MAX_MIB * 2**20:
        problems.append(f"{size / 2**20:.1f} MiB in all, over the {MAX_MIB} MiB a device call carries")
    return problems


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:] or [".whl"])[0])
    problems = check_dir(folder)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    for p in problems:
        print(f"{folder}: {p}", file=sys.stderr)
    if not problems:
        print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels as pinned, tokenizer, {size:.1f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
