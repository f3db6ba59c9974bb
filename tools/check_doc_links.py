"""Check the relative links of README.md and docs/*.md: every linked file exists, and every
#anchor names a heading of the linked Markdown file (GitHub's slugs). Exit 1 on a bad link.

    python tools/check_doc_links.py
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    out, seen, code = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                code = not code
                continue
            m = None if code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                out.add(s if n == 0 else f"{s}-{n}")
    return out


def main():
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    bad = 0
    for name in files:
        with open(name, encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, frag = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            where = os.path.relpath(name, ROOT)
            if not os.path.exists(full):
                print(f"{where}: no file {target}")
                bad += 1
            elif frag and full.endswith(".md") and frag not in anchors(full):
                print(f"{where}: no anchor {target}")
                bad += 1
    print(f"{len(files)} files, {bad} bad links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
