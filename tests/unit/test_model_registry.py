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


def test_minilm_builds_on_a_gpu_where_it_takes_larger_batches_than_the_catalogue_lists(monkeypatch):
    # The drift check read the instance's batch size, which MiniLM raises to
    # 1024 on a GPU: every GPU worker and endpoint refused to start.
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = build("minilm-embed")  # no load: nothing touches the device
    assert model.device.type == "cuda" and model.max_batch_size > CATALOGUE["minilm-embed"].max_batch_size
