#!/usr/bin/env python
"""Print one command line of the README's "Quick start" section, so CI runs exactly what a new user
copies and the two cannot drift apart.

Usage: readme_command.py N [README]   (N = 1 for the first ```bash block of the section, 2 for the second)
Exits non-zero with one `error:` line when the section or the block is missing or is not one line.
"""

import re
import sys
from pathlib import Path


def quick_start_commands(readme: str) -> list[str]:
    """The single-line ```bash blocks of the "## Quick start" section, in order."""
    section = re.search(r"^## Quick start.*?$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if section is None:
        raise ValueError('no "## Quick start" section in README.md')
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
    commands = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        if len(lines) != 1:
            raise ValueError(f"a Quick start block is not a single command line: {block!r}")
        commands.append(lines[0].strip())
    return commands


def main() -> int:
    if len(sys.argv) not in (2, 3) or not sys.argv[1].isdigit():
        print("usage: readme_command.py N [README]", file=sys.stderr)
        return 2
    n = int(sys.argv[1])
    path = Path(sys.argv[2]) if len(sys.argv) == 3 else Path(__file__).resolve().parent.parent / "README.md"
    try:
        commands = quick_start_commands(path.read_text(encoding="utf-8"))
        if not 1 <= n <= len(commands):
            raise ValueError(f"README Quick start has {len(commands)} command block(s), not {n}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(commands[n - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
