#!/usr/bin/env python3
"""The documentation's budgets (issue 61).

- README.md: at most 12 KB (what it is, the two commands, the API in brief,
  the at-most-once table, and links);
- each package README (clients/*/README.md): at most 12 KB;
- each file in docs/: at most 500 lines; docs/performance.md at most 300;
- all Markdown of the repository outside tests/ (and outside build output,
  node_modules and fuzz corpora): at most 180 KB.

A KB is 1,000 bytes. The Markdown counted is what git tracks or would track
(`git ls-files --cached --others --exclude-standard`), so ignored build
output never counts; outside a git checkout, a walk of the tree skipping
.git, target, node_modules and fuzz/corpus and fuzz/artifacts. Prints every
file's size, then each file over its budget, and exits 1 if there is one.

    python3 .ci/doc_budgets.py
"""
import os
import subprocess
import sys

KB = 1000
README_BYTES = 12 * KB
PACKAGE_README_BYTES = 12 * KB
DOC_LINES = 500
DOC_LINES_EXCEPT = {"docs/performance.md": 300}
TOTAL_BYTES = 180 * KB
SKIP_DIRS = {".git", "target", "node_modules", "tests"}
SKIP_PATHS = {"fuzz/corpus", "fuzz/artifacts"}


def markdown_files(root):
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md"],
            cwd=root, check=True, capture_output=True,
        ).stdout.decode()
        files = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            rel = os.path.relpath(d, root)
            dirs[:] = [
                x for x in dirs
                if x not in SKIP_DIRS and os.path.normpath(os.path.join(rel, x)) not in SKIP_PATHS
            ]
            files += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".md")]
    return sorted(
        {p for p in files
         if not p.startswith("tests/") and os.path.isfile(os.path.join(root, p))}
    )


def main():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    over = []
    total = 0
    print(f"{'bytes':>8} {'lines':>6}  file (budget)")
    for p in markdown_files(root):
        with open(os.path.join(root, p), "rb") as f:
            data = f.read()
        size, lines = len(data), data.count(b"\n")
        total += size
        budget = ""
        if p == "README.md":
            budget = f"<= {README_BYTES:,} bytes"
            if size > README_BYTES:
                over.append(f"{p}: {size:,} bytes, budget {README_BYTES:,}")
        elif p.startswith("clients/") and p.count("/") == 2 and p.endswith("/README.md"):
            budget = f"<= {PACKAGE_README_BYTES:,} bytes"
            if size > PACKAGE_README_BYTES:
                over.append(f"{p}: {size:,} bytes, budget {PACKAGE_README_BYTES:,}")
        elif p.startswith("docs/"):
            limit = DOC_LINES_EXCEPT.get(p, DOC_LINES)
            budget = f"<= {limit} lines"
            if lines > limit:
                over.append(f"{p}: {lines} lines, budget {limit}")
        print(f"{size:>8} {lines:>6}  {p}" + (f" ({budget})" if budget else ""))
    print(f"{total:>8} {'':>6}  all Markdown outside tests/ (<= {TOTAL_BYTES:,} bytes)")
    if total > TOTAL_BYTES:
        over.append(f"all Markdown outside tests/: {total:,} bytes, budget {TOTAL_BYTES:,}")
    if over:
        print("\nover budget:")
        for o in over:
            print(f"  {o}")
        return 1
    print("\nevery file within its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
