"""One error for a Hub name that did not load (a model, a dataset, a streamed dataset):
bad input when the clients are offline, worth a retry when the network failed."""

from __future__ import annotations

import pytest

from finetune.errors import OFFLINE_VARIABLES, PipelineError, TransientError, hub_unreachable


@pytest.mark.parametrize("variable", OFFLINE_VARIABLES)
def test_offline_it_is_bad_input_naming_the_key_and_the_local_way(monkeypatch, variable):
    for v in OFFLINE_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(variable, "1")
    error = hub_unreachable("data.dataset_name", "openai/gsm8k", OSError("x"),
                            "set data.json_file_path to a local file")
    assert type(error) is PipelineError and error.exit_code == 2
    assert str(error) == ("data.dataset_name 'openai/gsm8k': cannot load: HF_HUB_OFFLINE is set "
                          "and it is not in the local cache; with network access unset "
                          "HF_HUB_OFFLINE, or set data.json_file_path to a local file")


def test_online_it_is_retried_unless_the_name_may_not_exist(monkeypatch):
    for v in OFFLINE_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    streamed = hub_unreachable("data.dataset_name", "d", ConnectionError(), "x", verb="stream")
    assert type(streamed) is TransientError and "cannot stream" in str(streamed)
    assert "(ConnectionError)" in str(streamed)
    model = hub_unreachable("model.name_or_path", "m", OSError(), "x", retry_online=False)
    assert type(model) is PipelineError
