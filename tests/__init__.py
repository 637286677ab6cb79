import os

# Set before any test process loads torch's OpenMP runtime (pytest-xdist's workers inherit it): its
# threads otherwise spin while they wait, and on two cores one test worker's spinning starves the
# other worker and the servers and Ray workers the tests start. No test times anything; the suite
# runs 1.5x faster this way (docs/DEVELOPING.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
