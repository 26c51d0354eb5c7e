"""The benchmarks of jax-autocast, one package per question a reader brings (benchmarks/README.md).

Run each script from the repository root as ``python -m benchmarks.<question>.<script>``; each
writes its results to ``benchmarks/results/<question>/``.
"""
