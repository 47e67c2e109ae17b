"""A family's Hugging Face adapter (`Family.hf`): its config.json to and from the family's config, its tensor names
and layouts both ways, and the `architectures` it reads; numpy only, so train/hf/ moves tensors for any family
without naming one. A family's module `<family>_hf.py` builds one `HFAdapter`."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

import numpy as np

from models.protocols import ModelConfig

Params = dict[str, Any]  # our parameters as numpy, the layer stack in logical order (models/contract.py)
HFConfig = Mapping[str, Any]  # a config.json as a dict
Index = tuple | None  # a block of one of our leaves (a tuple of slices), or None for all of it


class Read(Protocol):
    def __call__(self, name: str) -> np.ndarray:
        """An HF tensor by name (may be memory-mapped, so slice before converting)."""


class FieldsFromHF(Protocol):
    def __call__(self, hf: HFConfig) -> dict[str, Any]:
        """Our model fields that config.json decides (the shapes and the architecture's options); raises
        KeyError or models.ModelConfigError for a config this family cannot take."""


class ToHFConfig(Protocol):
    def __call__(self, cfg: ModelConfig, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        """config.json for our config `cfg`, its tensors in `dtype`."""


class HFShapes(Protocol):
    def __call__(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds, with its shape."""


class ToHF(Protocol):
    def __call__(self, params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
        """Our params -> HF tensors by name, C-contiguous."""


class LayerFromHF(Protocol):
    def __call__(self, read: Read, key: str, i: int, cfg: ModelConfig, index: Index = None) -> np.ndarray:
        """Our per-layer leaf `key` of layer i (or its block `index`), reading only the rows that block needs;
        a leaf nested in the stack (a mixture's `experts/w_in`) is named by its path joined with '/'."""


class TopFromHF(Protocol):
    def __call__(self, read: Read, key: str, cfg: ModelConfig, index: Index = None) -> np.ndarray:
        """Our leaf `key` outside the layer stack (or its block `index`)."""


class Unsupported(Protocol):
    def __call__(self, cfg: ModelConfig) -> str | None:
        """Why `cfg` has no Hugging Face form (a phrase naming the setting and its fix), or None when it has."""


class Rename(Protocol):
    def __call__(self, name: str) -> str:
        """A tensor name as a file spells it -> the name the adapter reads (prefixes some files leave out)."""


def same_name(name: str) -> str:
    return name


def always_supported(cfg: ModelConfig) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class HFAdapter:
    """What train/hf/ needs of a family to import (`restore_from=hf:DIR`) and export (`train.export_hf`):
    `architectures` names the config.json `architectures` entries it reads (the import picks the family by them);
    `ignored` tensor-name suffixes a file may carry beside the weights (buffers recomputed here); `left_out` name
    prefixes (after `rename`) of parts of a larger model that are not imported, each with what it is (a multimodal
    checkpoint's vision tower), named in one line when a directory has them."""
    architectures: tuple[str, ...]
    fields_from_hf: FieldsFromHF
    hf_config: ToHFConfig
    hf_shapes: HFShapes
    to_hf: ToHF
    layer_from_hf: LayerFromHF
    top_from_hf: TopFromHF
    unsupported: Unsupported = always_supported
    rename: Rename = same_name
    ignored: tuple[str, ...] = ()
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)


def slices(index: Index, ndim: int) -> tuple:
    """`index` completed with whole slices to `ndim` dimensions."""
    index = tuple(index or ())
    return index + (slice(None),) * (ndim - len(index))


def span(s: slice, n: int) -> tuple[int, int]:
    """(start, stop) of a unit-step slice of a dimension of size n."""
    start, stop, step = s.indices(n)
    assert step == 1, s
    return start, stop
