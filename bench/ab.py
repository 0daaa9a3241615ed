"""A restructuring's speed check: bench rows' embedlens commands run from another tree of
embedlens (OLD, e.g. a `git worktree` of the commit before) and from this one, alternating.

    git worktree add --detach ../old COMMIT
    python bench/ab.py ../old --runs 5 [--only TEXT ...]

Each run is a whole process timed by run.py's `run_once` (wall clock, CPU from rusage, peak
resident set); OLD and this tree are put first on PYTHONPATH in turn, a warm-up of each first
(bytecode, page cache), then the runs alternate (old-new, new-old, ...). Prints a row per command:
the medians and new / old. Rows against the bench's local hub are left out. Build the bench's
files first (`python bench/run.py --runs 1` or its `--build-only`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Row, bench_env, rows, run_once  # noqa: E402  (bench/ beside this script)


def argv(row: Row) -> list[str]:
    """The row's command, embedlens run as `python -m embedlens` (so PYTHONPATH picks the tree)."""
    cmd = list(row.command)
    if cmd[0].endswith("embedlens"):
        return [sys.executable, "-m", "embedlens", *cmd[1:]]
    return cmd


def compare(row: Row, trees: dict[str, Path], runs: int, env: dict[str, str]) -> dict:
    """`runs` timed runs of the row's command from each tree, alternating. Each runs in its
    tree's folder: `python -m` and `python -c` put the working folder first on sys.path, before
    PYTHONPATH, so run from this tree both would import this tree's embedlens."""
    envs = {k: {**env, "PYTHONPATH": str(tree)} for k, tree in trees.items()}
    for k, tree in trees.items():
        check_imports(tree, envs[k])
        run_once(argv(row), envs[k], cwd=tree)
    got: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for i in range(runs):
        for k in ("old", "new") if i % 2 == 0 else ("new", "old"):
            load = os.getloadavg()[0]
            wall, peak, cpu = run_once(argv(row), envs[k], cwd=trees[k])
            got[k].append({"wall": wall, "cpu": cpu, "peak_mb": peak, "load": load})
    return got


def check_imports(tree: Path, env: dict[str, str]) -> None:
    """Stop unless a process run as `compare` runs one imports embedlens from `tree`."""
    code = "import embedlens; print(embedlens.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"error: a run meant for {tree} imports embedlens from {found}")


def line(name: str, got: dict[str, list[dict[str, float]]]) -> str:
    def med(k: str, key: str) -> float:
        return statistics.median(x[key] for x in got[k])

    old, new = med("old", "wall"), med("new", "wall")
    cpu = med("new", "cpu") / med("old", "cpu")
    peaks = [max(x["peak_mb"] for x in got[k]) for k in ("old", "new")]
    return (
        f"| {name} | {len(got['old'])} | {old:.2f} s | {new:.2f} s | {new / old:.3f} | {cpu:.3f} "
        f"| {peaks[0]:.0f} / {peaks[1]:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the other tree (a folder holding embedlens/)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each, per tree")
    parser.add_argument("--only", action="append", help="the rows whose name holds TEXT")
    parser.add_argument("--json", type=Path, help="also write every run here")
    args = parser.parse_args()
    if not (args.old / "embedlens" / "__init__.py").is_file():
        raise SystemExit(f"error: {args.old} holds no embedlens/ package")
    env = bench_env()
    trees = {"old": args.old.resolve(), "new": HERE.parent}
    table, _, _ = rows(False)
    seen: set[tuple[str, ...]] = set()
    results: dict[str, dict] = {}
    print("| row | runs | old | new | new / old | CPU new / old | peak MB old / new |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in table:
        if row.hub or tuple(row.command) in seen:
            continue
        if args.only and not any(text in row.name for text in args.only):
            continue
        seen.add(tuple(row.command))
        results[row.name] = compare(row, trees, args.runs, env)
        print(line(row.name, results[row.name]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
