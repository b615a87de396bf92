"""The jobs the benchmarks start under mpiexec, each run as ``python -m bench.workers.NAME``."""
