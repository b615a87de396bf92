"""Writes the README's training loop to a file, its training stopped after a few batches.

    python readme_snippet.py README.md OUT.py [BATCHES]
"""
import sys

text = open(sys.argv[1]).read()
code = text.split("## A training loop", 1)[1].split("```python", 1)[1].split("```", 1)[0]
loop = "for x, y in LayerParallelLoader(train, 64, comm=model):"
assert code.count(loop) == 1, "the README's training loop changed: update .ci/readme_snippet.py"
batches = int(sys.argv[3]) if len(sys.argv) > 3 else 3
short = f"for _, (x, y) in zip(range({batches}), LayerParallelLoader(train, 64, comm=model)):"
open(sys.argv[2], "w").write(code.replace(loop, short))
