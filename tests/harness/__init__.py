"""The multi-rank test harness: the models and data by name (``models``), the DeepSpeed config, the
single-process reference, an engine run and the cases as records (``runs``), and launches run once per test
module by the one ``runs`` fixture (``launch``; the fixture is in tests/conftest.py)."""
