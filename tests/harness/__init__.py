"""The multi-rank test harness: the models and data by name (``models``), the DeepSpeed config, the
single-process reference, an engine run and the cases as records (``runs``), the pipeline's layer-spec models,
reference, engine and runs as records (``pipeline``: ``PipeCase``, ``pipe_suite``), the checkpoint tests' resumable
stream, jobs as records and their reference (``checkpoints``: ``CheckpointJob``, ``run_jobs``), launches run once
per test module by the one ``runs`` fixture (``launch``; the fixture is in tests/conftest.py), and DeepSpeedExamples'
pipeline example with the environment it needs on a CPU machine (``deepspeed_examples``).

A test module declares its engine runs as ``Case`` records (a model of ``MODELS``, a config from ``ds_config`` /
``zero3_config``; ``per_step`` records each step's row) and launches ``world_suite`` with them; a run the
records cannot express (a bespoke loop, an API read mid-training) is a rank entry point in the test module
itself, launched the same way, reading its cases from the same records where it can; launches that share a world
size go into one launch where the runs allow it (process start-up is the slow part on a small machine). The
per-feature helper modules that re-defined models, configs, references and loops are folded in here (issue 37
item 7); under tests/integration stay only the subprocess scripts (``_accelerate_script``, ``_hf_*``,
``_autotune_script``, ``_estimate_cases``) and the inference and ZeRO-3 API helpers (``_inference_models``,
``_moe_inference``, ``_zero3_api``).
"""
