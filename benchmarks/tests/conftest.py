import os

# Keep every BLAS / OpenMP pool to one thread, as tests/conftest.py does: the suite runs several
# ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
