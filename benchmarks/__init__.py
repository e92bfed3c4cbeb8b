"""Side-by-side benchmarks against the peers (`make bench` or `python -m benchmarks`)."""
