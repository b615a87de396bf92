"""layerbraid's benchmarks and the reports of docs/ they write.

Run from the repository's root, each entry point as a module: ``python -m bench`` lists every
report with its command and the stale ones; ``python -m bench.NAME`` regenerates one report.
The workers those entry points start under mpiexec are bench/workers/.
"""
