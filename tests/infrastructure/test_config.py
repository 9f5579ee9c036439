"""The typed configuration: context values (JSON or command-line strings) in, checked values out."""

from __future__ import annotations

import pytest
from aws_cdk import App

from cdk.build import cdk_json_context
from cdk.config import SluiceConfig, UsagePlan


def test_cdk_json_defaults_match_the_dataclass():
    from_json = SluiceConfig.from_dict(cdk_json_context()["sluice"])
    assert from_json == SluiceConfig()


def test_command_line_strings_are_parsed():
    config = SluiceConfig.from_dict(
        {
            "backends": "eks",
            "max_workers": "16",
            "waf": "false",
            "gpu_instance_types": "g6.xlarge,g6.2xlarge",
            "oldest_message_slo_s": '{"high": 30, "normal": 120, "low": 900}',
            "usage_plans": '[{"name": "bulk", "rate_per_s": 5, "burst": 10, "quota_per_day": 100}]',
            "alarm_email": "ops@example.com",
        }
    )
    assert config.backends == ("eks",)
    assert config.max_workers == 16 and config.waf is False
    assert config.gpu_instance_types == ("g6.xlarge", "g6.2xlarge")
    assert config.oldest_message_slo_s["high"] == 30
    assert config.usage_plans == (UsagePlan("bulk", 5, 10, 100),)
    assert config.alarm_email == "ops@example.com"


def test_derived_timeouts_cover_the_longest_batch():
    config = SluiceConfig(longest_batch_s=45)
    assert config.visibility_timeout_s > config.longest_batch_s
    assert config.longest_batch_s < config.dispatcher_timeout_s <= config.visibility_timeout_s
    assert config.termination_grace_s > config.longest_batch_s


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"backends": "ecs"}, "backends"),
        ({"max_workers": "lots"}, "max_workers"),
        ({"min_workers": 5, "max_workers": 2}, "min_workers"),
        ({"longest_batch_s": 120}, "SageMaker"),
        ({"dispatcher_max_concurrency": {"high": 1, "normal": 2, "low": 2}}, "dispatcher_max_concurrency"),
        ({"oldest_message_slo_s": {"high": 1}}, "oldest_message_slo_s"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_wait_ms": -5}, "max_wait_ms"),
        ({"result_ttl_days": 0}, "result_ttl_days"),
        ({"dispatcher_batch_size": 101}, "dispatcher_batch_size"),
        ({"no_such_option": 1}, "unknown"),
        ({"concurrent_requests_per_instance": 0}, "concurrent_requests_per_instance: more than 0"),
        ({"sagemaker_instance_type": "ml.m5.xlarge"}, "sagemaker_instance_type: 'ml.m5.xlarge' has no NVIDIA GPU"),
        ({"sagemaker_instance_type": "ml.inf2.xlarge"}, "sagemaker_instance_type"),
        ({"backends": "eks", "gpu_instance_types": "g5.xlarge,c5.xlarge"}, "gpu_instance_types: 'c5.xlarge'"),
        ({"backends": "eks", "gpu_instance_types": "g4ad.xlarge"}, "gpu_instance_types"),
        # SQS takes queue names of up to 80 characters: `<prefix>-normal-dlq` is 11 more.
        ({"name_prefix": "a" * 70}, "name_prefix"),
        ({"name_prefix": "team.a prod"}, "name_prefix"),
        ({"name_prefix": ""}, "name_prefix"),
        # The autoscaler's image is tagged v<kubernetes_version>.0.
        ({"kubernetes_version": "1.35.2"}, "kubernetes_version: '1.35.2' should be a minor version"),
        ({"kubernetes_version": "v1.35"}, "kubernetes_version"),
    ],
)
def test_invalid_configuration_is_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        SluiceConfig.from_dict(raw)


def test_the_replaced_invocations_per_instance_option_is_refused_naming_its_successor():
    # Its value (invocations per minute) means nothing as a concurrency target.
    with pytest.raises(ValueError) as refused:
        SluiceConfig.from_dict({"invocations_per_instance": 600})
    (line,) = str(refused.value).splitlines()
    assert line.startswith("sluice.invocations_per_instance: removed")
    assert "set sluice.concurrent_requests_per_instance instead" in line


@pytest.mark.parametrize(
    "key, message",
    [
        ("sluice.invocations_per_instance", "set sluice.concurrent_requests_per_instance instead"),
        ("sluice.max_worker", "unknown sluice context options: max_worker"),
    ],
)
def test_a_dotted_command_line_option_that_is_not_one_is_refused(key, message):
    # `cdk deploy -c sluice.<option>=...`: once read only for known options, so these went unnoticed.
    app = App(context={"sluice": cdk_json_context()["sluice"], key: "16"})
    with pytest.raises(ValueError, match=message):
        SluiceConfig.from_context(app.node)


def test_dotted_command_line_options_override_the_context_dict():
    app = App(context={"sluice": cdk_json_context()["sluice"], "sluice.concurrent_requests_per_instance": "1.5",
                       "sluice.max_workers": "16"})
    config = SluiceConfig.from_context(app.node)
    assert config.concurrent_requests_per_instance == 1.5 and config.max_workers == 16


@pytest.mark.parametrize("types", ["g4dn.xlarge,g5.2xlarge,g6e.xlarge,p4d.24xlarge,p5.48xlarge", "g6.xlarge"])
def test_nvidia_instance_families_are_accepted(types):
    config = SluiceConfig.from_dict({"backends": "eks,sagemaker", "gpu_instance_types": types,
                                     "sagemaker_instance_type": "ml." + types.split(",")[0]})
    assert config.sagemaker_instance_type.startswith("ml.")


@pytest.mark.parametrize("models, rule", [
    ("minilm", "unknown model 'minilm'; the catalogue has minilm-embed, synthetic"),
    (" , ", "names no model"),
])
def test_models_outside_the_catalogue_are_refused_at_synth(models, rule):
    """Every side refuses them as it starts, which on AWS is after the deploy."""
    with pytest.raises(ValueError, match=f"models: {models!r} {rule}"):
        SluiceConfig.from_dict({"models": models})
