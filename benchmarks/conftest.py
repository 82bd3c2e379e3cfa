"""Benchmarks are not tests: keep pytest (and CI) from collecting anything here.

A test that wants a quick end-to-end check can run ``python benchmarks/run_compare.py
--smoke --out <tmpdir>`` in a subprocess.
"""

collect_ignore_glob = ["*"]
