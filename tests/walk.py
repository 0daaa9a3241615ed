"""Walk a public function's data path through embedlens' modules, as a reader would follow it.

    python -m tests.walk vocab MODEL            # or: lens MODEL / tune MODEL / params MODEL
    python -m tests.walk vocab MODEL --show     # every visit, in order

Definitions (what `walk` counts):

- A *call* is a Python function of embedlens starting to run (`sys.setprofile`'s 'call' event,
  in the calling thread and every thread started during the walk), with the nearest embedlens frame below it on the stack as its
  caller; frames of other packages in between (torch, transformers running an embedlens hook or
  patch) are seen through, and so is the envelope every public function runs in
  (`embedlens.guest`). Import-time code is not the data path: a module's body (`<module>`)
  and everything it calls are left out.
- A *visit* is a call whose function lies in another module than its caller's, counted once per
  (caller function, called function) pair however often it runs: the reader follows each call
  from one module into another once, a loop over 50,000 tokens does not make 50,000 visits. The
  first call into embedlens (the public function) is the start, not a visit. A comprehension or
  generator expression is read as part of the function whose text holds it (Python 3.12 runs
  comprehensions inside that function's frame: the count does not depend on the release).
- A *move back up* is a visit from a module of a lower layer into one of a higher layer
  (`LAYERS`): io calling into model, model into analysis (a callback, a method of a higher
  layer's object, a generator of a higher layer resumed). Returns are no calls and never count.

The layers are those the import-direction test holds (tests/layers.py, `layer_of`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import embedlens
from tests.layers import layer_of

PACKAGE = Path(embedlens.__file__).resolve().parent
"""The package's own folder: its files are the project's code, wherever the clone and its venv lie
(a venv inside a clone named `embedlens` holds numpy under `embedlens/.venv/`)."""


def package_prefixes(package: Path = PACKAGE) -> tuple[str, ...]:
    """The prefixes a file of the package starts with: its folder as given and as resolved."""
    given = str(package.absolute()).replace("\\", "/").rstrip("/") + "/"
    real = os.path.realpath(package).replace("\\", "/").rstrip("/") + "/"
    return tuple(dict.fromkeys((given, real)))


def package_module(filename: str, prefixes: tuple[str, ...]) -> str | None:
    """The dotted module of the package a file holds (under one of prefixes), or None."""
    name = filename.replace("\\", "/")
    if not name.endswith(".py"):
        return None
    for prefix in prefixes:
        if name.startswith(prefix):
            dotted = "embedlens." + name[len(prefix) : -3].replace("/", ".")
            return dotted.removesuffix(".__init__")
    return None


@dataclass
class Walk:
    """The visits of one walk, in the order first made: (from module, to module) each."""

    visits: list[tuple[str, str]] = field(default_factory=list)
    seen: set[tuple[CodeType, CodeType]] = field(default_factory=set)

    @property
    def modules(self) -> set[str]:
        return {m for pair in self.visits for m in pair}

    @property
    def moves_up(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.visits if layer_of(a) < layer_of(b)]

    def summary(self) -> str:
        return (
            f"{len(self.visits)} visits in {len(self.modules)} modules, "
            f"{len(self.moves_up)} moves back up"
        )


_INLINE = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})
"""Code objects of a comprehension or generator expression: part of the function holding them."""


ENVELOPE = "embedlens.guest"
"""What every public function runs inside (the process put back as it was after): seen
through, as other packages are, so that the public function itself is the start."""


def _module(code: CodeType, files: dict[str, str | None], prefixes: tuple[str, ...]) -> str | None:
    """The embedlens module a code object belongs to, or None."""
    name = code.co_filename
    if name not in files:
        found = package_module(name, prefixes)
        files[name] = None if found == ENVELOPE else found
    return files[name]


def walk(func: Callable[[], Any], package: Path = PACKAGE) -> tuple[Walk, Any]:
    """Run func() under the walk; return the walk and what func returned. package: the folder
    whose files are embedlens' modules (the installed package's own unless told)."""
    record = Walk()
    files: dict[str, str | None] = {}
    prefixes = package_prefixes(package)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _module(frame.f_code, files, prefixes)
        if callee is None or frame.f_code.co_name == "<module>":
            return
        below = frame.f_back
        while below is not None and _module(below.f_code, files, prefixes) is None:
            below = below.f_back
        if below is None:
            return  # the start
        below = _holder(below)
        if _importing(below, files, prefixes):
            return
        caller = _module(below.f_code, files, prefixes)
        assert caller is not None
        if caller == callee:
            return
        key = (below.f_code, frame.f_code)
        if key not in record.seen:
            record.seen.add(key)
            record.visits.append((caller, callee))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        result = func()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return record, result


def _holder(frame: FrameType) -> FrameType:
    """The frame of the function whose text holds frame's comprehension or generator expression
    (frame itself when it runs a function, or when its holder is not on the stack)."""
    held = frame
    while held.f_code.co_name in _INLINE:
        code, up = held.f_code, held.f_back
        while up is not None and code not in up.f_code.co_consts:
            up = up.f_back
        if up is None:
            return frame
        held = up
    return held


def _importing(
    frame: FrameType | None, files: dict[str, str | None], prefixes: tuple[str, ...]
) -> bool:
    """Whether an embedlens module's body is running at or below frame (an import)."""
    while frame is not None:
        if (
            frame.f_code.co_name == "<module>"
            and _module(frame.f_code, files, prefixes) is not None
        ):
            return True
        frame = frame.f_back
    return False


def _main(argv: list[str]) -> None:
    import tempfile

    command, model = argv[0], argv[1]
    show = "--show" in argv
    if command == "vocab":
        record, _ = walk(lambda: embedlens.vocab(model))
    elif command == "params":
        record, _ = walk(lambda: embedlens.params(model))
    elif command == "lens":
        record, _ = walk(lambda: embedlens.lens(model, "The capital of France is"))
    elif command == "tune":
        folder = Path(tempfile.mkdtemp(prefix="walk-"))
        data = folder / "data.txt"
        data.write_text(("the cat sat on the mat and the dog ran " * 400).strip(), "utf-8")
        record, _ = walk(
            lambda: embedlens.tune(
                model, data, folder / "lens", tokens=512, eval_tokens=128, steps=1
            )
        )
    else:
        raise SystemExit(f"unknown command {command}")
    if show:
        for a, b in record.visits:
            up = "  ^ UP" if layer_of(a) < layer_of(b) else ""
            print(f"{a} -> {b}{up}")
    print(f"{command}: {record.summary()}")


if __name__ == "__main__":
    _main(sys.argv[1:])
