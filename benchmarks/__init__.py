"""Scripts that measure Kiln side by side with a baseline, in one run (`python benchmarks/X.py` or
`python -m benchmarks.X`, from the repository root), and what they share (common.py, synthetic.py).
Each has a CPU smoke run in the test suite (tests/unit/test_benchmarks.py); results/ holds what they
measured and where."""
