"""Model catalogue. Importing it never imports torch: the API lists models from
here while only workers construct and load them."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from models.base import Model


@dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    max_batch_size: int
    description: str
    factory: str  # "module:Class", imported only when a worker builds the model


CATALOGUE: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="minilm-embed",
            version="all-MiniLM-L6-v2",
            max_batch_size=64,
            description="Sentence embeddings: 384 dims, mean pooled, L2-normalized. Reads the first 256 word pieces "
            "of an input (about 1,000 characters of English); the rest is ignored.",
            factory="models.minilm:MiniLMEmbed",
        ),
        ModelSpec(
            name="synthetic",
            version="1",
            max_batch_size=256,
            description="Costs a + b*n ms per batch. For load and fault tests: where its workers run with "
            "SLUICE_SYNTHETIC_FAULTS=1 it refuses inputs containing '!fail' and crashes on '!crash'.",
            factory="models.synthetic:SyntheticModel",
        ),
    )
}


def get_spec(name: str) -> ModelSpec | None:
    return CATALOGUE.get(name)


def build(name: str, **options) -> Model:
    spec = CATALOGUE[name]
    module_name, class_name = spec.factory.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    model = cls(**options)
    # The API lists and records the catalogue's values, the worker the class's:
    # written twice, they must say the same (a version bumped in one place
    # would record results under a version the API never showed). The batch
    # size is the class's own: an instance may take more on a GPU (MiniLM's 1024).
    said = {"name": model.name, "version": model.version,
            "max_batch_size": getattr(cls, "max_batch_size", getattr(model, "max_batch_size", None))}
    drift = [f"{field} {value!r} where the catalogue says {getattr(spec, field)!r}"
             for field, value in said.items() if value != getattr(spec, field)]
    if drift:
        raise ValueError(f"model {name} ({spec.factory}) has " + "; ".join(drift) + ": make models/registry.py agree")
    return model


def load_models(names: list[str], torch_threads: int = 0) -> dict[str, Model]:
    """Build and load each named model once, for a worker or a serving process."""
    # Before a model imports torch and with it the OpenMP runtime: idle OpenMP
    # threads sleep instead of spinning. A model shares its cores with the
    # process's own I/O threads; with spinning threads a batch-32 forward took
    # ~950 ms in the worker against ~50 ms alone, passive ~60-120 ms
    # (docs/benchmarks.md, "What was changed").
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    models: dict[str, Model] = {}
    for name in names:
        model = build(name)
        model.load()
        models[name] = model
    # Only if a model brought torch in: a synthetic-only worker stays ~200 MB lighter.
    torch = sys.modules.get("torch")
    if torch_threads and torch is not None:
        torch.set_num_threads(torch_threads)
    return models
