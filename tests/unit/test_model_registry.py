"""The catalogue against the model classes it names: what a team adding its own
model is held to before a worker starts."""

from __future__ import annotations

import pytest

from models import registry
from models.registry import CATALOGUE, ModelSpec, build


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_each_catalogue_entry_builds_a_model_that_says_what_the_catalogue_says(name):
    model = build(name)  # no load: the weights are not read
    spec = CATALOGUE[name]
    assert (model.name, model.version, model.max_batch_size) == (spec.name, spec.version, spec.max_batch_size)


class ClassifierV2:
    name, version, max_batch_size, description = "text-clf", "2", 8, "labels"


def test_a_model_whose_class_and_catalogue_entry_disagree_does_not_build(monkeypatch):
    # It used to build: GET /v1/models showed version 1 and results said 2.
    monkeypatch.setattr(registry, "ClassifierV2", ClassifierV2, raising=False)
    monkeypatch.setitem(CATALOGUE, "text-clf", ModelSpec("text-clf", "1", 8, "labels", "models.registry:ClassifierV2"))
    with pytest.raises(ValueError, match=r"text-clf .* version '2' where the catalogue says '1'"):
        build("text-clf")
