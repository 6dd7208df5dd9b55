"""validate_ds_config reports problems for any value at any key path and never crashes on them."""
from __future__ import annotations

import typing
import warnings

from pydantic import BaseModel

from dsrun.config import DSConfig, validate_ds_config

ODD_VALUES = [None, "x", [1], {"a": 1}]


def _key_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> typing.Iterator[tuple[str, ...]]:
    for name, field in model.model_fields.items():
        yield (*prefix, name)
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel) and len(prefix) < 4:
                yield from _key_paths(candidate, (*prefix, name))
                break


def test_every_key_path_with_odd_values_gives_problems_not_crashes():
    paths = list(_key_paths(DSConfig))
    assert len(paths) > 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in paths:
            for value in ODD_VALUES:
                config: dict = {"train_micro_batch_size_per_gpu": 1}
                node = config
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = value
                problems = validate_ds_config(config)
                assert isinstance(problems, list)
                # a value that is rejected is reported at (or below) the key that holds it
                for problem in problems:
                    assert problem.path, (path, value)
