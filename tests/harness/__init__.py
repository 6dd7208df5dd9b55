"""The multi-rank test harness: the models and data by name (``models``), the DeepSpeed config, the
single-process reference, an engine run and the cases as records (``runs``), the pipeline's layer-spec models,
reference, engine and runs as records (``pipeline``: ``PipeCase``, ``pipe_suite``), launches run once per
test module by the one ``runs`` fixture (``launch``; the fixture is in tests/conftest.py), and DeepSpeedExamples'
pipeline example with the environment it needs on a CPU machine (``deepspeed_examples``).

A test module declares its engine runs as ``Case`` records (a model of ``MODELS``, a config from ``ds_config`` /
``zero3_config``; ``per_step`` records each step's row) and launches ``world_suite`` with them; a run the
records cannot express (a bespoke loop, an API read mid-training) is a rank entry point in the test module
itself, launched the same way, reading its cases from the same records where it can. Per-feature helper
modules under tests/integration are being folded in here (issue 37 item 7).
"""
