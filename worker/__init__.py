"""The worker: the engine, its model and attention backends, and the server around them."""

from worker.numerics import reproducible_blas

# Before any worker module runs a matmul: MKL reads its reproducibility mode once (numerics.py).
reproducible_blas()
