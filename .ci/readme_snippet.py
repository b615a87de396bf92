"""Writes the README's layer-parallel training loop to a file, stopped after a few batches.

    python readme_snippet.py README.md OUT.py [BATCHES]
"""
import sys

text = open(sys.argv[1]).read()
code = text.split("## Training, layer-parallel", 1)[1].split("```python", 1)[1].split("```", 1)[0]
loop = "for step, (x, y) in enumerate(loader):"
assert code.count(loop) == 1, "the README's training loop changed: update .ci/readme_snippet.py"
batches = int(sys.argv[3]) if len(sys.argv) > 3 else 3
open(sys.argv[2], "w").write(code.replace(loop, f"for step, (x, y) in zip(range({batches}), loader):"))
