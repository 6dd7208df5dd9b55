"""The building blocks every section model shares.

Every section is a :class:`Section`: a pydantic model that forbids unknown keys (DeepSpeed ignores unknown
keys in most sections; dsrun reports them with a suggestion), accepts DeepSpeed's key names as attribute
names, and renders back to a DeepSpeed JSON dict with :meth:`Section.to_ds_dict`.

Numbers: DeepSpeed configs write sizes as ``5e8``; an integer field accepts a float with no fractional part
(pydantic's lax mode does this), and a size field is ``>= 0`` as DeepSpeed's own ZeRO models require.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
OpenDict = dict[str, Any]
# A value as the user wrote it, before any type is known: parsed JSON, or any Python object in a config dict
# built in code (a torch.dtype). Before-validators and error reports take every such value.
RawValue = object

DTYPE_NAMES = ("fp16", "bf16", "fp32")


def lower_text(value: RawValue) -> RawValue:
    """A string lower-cased (DeepSpeed compares names case-insensitively); any other value as it is."""
    return value.lower() if isinstance(value, str) else value


# DeepSpeed lower-cases dtype names before comparing them ("FP16" is accepted).
DTypeName = Annotated[Literal["fp16", "bf16", "fp32"], BeforeValidator(lower_text)]

# The other spellings DeepSpeed's ``DtypeEnum`` takes where it resolves a dtype (``torch_autocast.dtype``, the
# ``data_types`` keys): DeepSpeedExamples' bf16_full.json writes "torch.bfloat16". A torch.dtype object (a
# config dict built in Python) reads as its name. Stored as the short name.
_DTYPE_SPELLINGS = {
    "torch.float16": "fp16", "float16": "fp16", "half": "fp16",
    "torch.bfloat16": "bf16", "bfloat16": "bf16",
    "torch.float32": "fp32", "float32": "fp32", "float": "fp32",
}


def _dtype_name(value: RawValue) -> RawValue:
    if type(value).__name__ == "dtype":  # torch.bfloat16 and friends, without importing torch here
        value = str(value)
    value = lower_text(value)
    return _DTYPE_SPELLINGS.get(value, value) if isinstance(value, str) else value


TorchDTypeName = Annotated[Literal["fp16", "bf16", "fp32"], BeforeValidator(_dtype_name)]


class Section(BaseModel):
    """Base of every DeepSpeed config section: unknown keys are errors; DeepSpeed key names are fields.

    ``_explicit_only`` names fields written back by :meth:`to_ds_dict` only when the user set them (keys
    whose absence means something different to DeepSpeed than any value, e.g. ``overlap_comm``).
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        protected_namespaces=(),
        validate_default=False,
        arbitrary_types_allowed=False,
    )

    # Keys accepted (documented) but never written back, because DeepSpeed itself would reject them.
    not_written_keys: ClassVar[frozenset[str]] = frozenset()

    def to_ds_dict(self) -> dict[str, Any]:
        """This section as DeepSpeed JSON: the keys the user set (after migration and "auto" resolution),
        by their DeepSpeed names, nested sections included.

        Unset keys are left out so DeepSpeed applies its own (identical) default; this keeps the file
        loadable by DeepSpeed releases that predate a key dsrun knows.
        """
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            if name in self.model_fields_set and name not in self.not_written_keys:
                out[name] = _dump(getattr(self, name))
        return out


def _dump(value: RawValue) -> RawValue:
    if isinstance(value, Section):
        return value.to_ds_dict()
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value
