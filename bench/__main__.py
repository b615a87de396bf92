"""``python -m bench``: every report of docs/, the command that regenerates it, and the stale
ones; ``python -m bench --run all`` regenerates them (see bench/reports.py)."""
import sys

from bench.reports import main

sys.exit(main())
