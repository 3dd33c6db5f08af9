"""Print the Nth bash block under README.md's "## The two commands" (1: install and run the
default model, 2: install and run the tests), so CI runs what a newcomer copies."""

import re
import sys
from pathlib import Path

readme = Path(__file__).resolve().parents[1] / "README.md"
section = readme.read_text().split("## The two commands", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
if len(blocks) != 2:
    sys.exit(f"README.md: {len(blocks)} bash blocks under 'The two commands', not 2")
print(blocks[int(sys.argv[1]) - 1].strip())
