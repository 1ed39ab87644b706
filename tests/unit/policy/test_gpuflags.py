"""Mesos's FlagValidation cases (reference/mesos-gpu-isolator.md section 3.1), in its order."""

from __future__ import annotations

import pytest

from isolator.errors import ConfigError
from isolator.policy.gpuflags import GpuFlags, decide, parse_gpus, wants_nvml

COUNT = 4  # the machine's GPUs as NVML reports them


def test_case_1_without_gpu_isolation_default_flags_advertise_no_gpus():
    assert decide("", None, COUNT, isolation=False) == GpuFlags(gpus=None)


def test_case_2_devices_without_gpu_isolation_are_refused():
    with pytest.raises(ConfigError, match=r"'--nvidia-gpu-devices' can only be specified if GPU isolation"):
        decide("gpus:1", (0,), COUNT, isolation=False)


def test_case_3_without_gpu_isolation_gpus_pass_through_unvalidated():
    assert decide("gpus:100", None, COUNT, isolation=False) == GpuFlags(gpus=100)


def test_case_4_resources_without_gpus_auto_discover_every_gpu():
    assert decide("cpus:1", None, COUNT) == GpuFlags(gpus=COUNT, indices=(0, 1, 2, 3), discovered=True)


def test_case_5_gpus_0_opts_out_of_discovery():
    assert decide("gpus:0", None, COUNT) == GpuFlags(gpus=None)


def test_case_6_devices_with_matching_gpus_are_managed():
    assert decide("gpus:1", (0,), COUNT) == GpuFlags(gpus=1, indices=(0,))


def test_case_7_devices_without_gpus_in_resources_are_refused():
    with pytest.raises(ConfigError, match=r"cannot be set without also setting 'gpus' in '--resources'"):
        decide("cpus:1", (0,), COUNT)


def test_case_8_gpus_without_devices_are_refused():
    with pytest.raises(
        ConfigError, match=r"The 'gpus' resource cannot be set without also setting '--nvidia-gpu-devices'"
    ):
        decide(f"gpus:{COUNT}", None, COUNT)


def test_case_9_gpus_and_devices_of_different_lengths_are_refused():
    with pytest.raises(ConfigError, match=r"specify different numbers of GPU devices"):
        decide("gpus:2", (0,), COUNT)


def test_case_10_devices_with_gpus_0_are_refused():
    with pytest.raises(ConfigError, match=r"cannot be specified when '--resources' specifies 0 GPUs"):
        decide("gpus:0", (0,), COUNT)


def test_case_11_more_gpus_than_the_machine_has_are_refused():
    n = 2 * COUNT
    with pytest.raises(ConfigError, match=r"greater than the number of GPUs available on the machine"):
        decide(f"gpus:{n}", tuple(range(n)), COUNT)


def test_case_12_duplicate_devices_are_refused():
    with pytest.raises(ConfigError, match=r"'--nvidia-gpu-devices' contains duplicates"):
        decide("cpus:1;gpus:1", (0, 0), COUNT)


@pytest.mark.parametrize("value", ["0.5", "-1", "1.25", "nan", "inf"])
def test_fractional_or_negative_gpus_are_refused(value):
    with pytest.raises(ConfigError, match=r"must be a non-negative integer|must be a scalar"):
        decide(f"gpus:{value}", (0,), COUNT)


def test_device_index_that_nvml_does_not_report_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"names GPU 7, but NVML reports GPUs 0-3 only"):
        decide("gpus:1", (7,), COUNT)


def test_requested_gpus_without_nvml_give_one_clear_error():
    with pytest.raises(ConfigError, match=r"^gpus requested but NVML not found: no driver$"):
        decide("gpus:1", (0,), None, nvml_problem="no driver")


def test_auto_discovery_without_nvml_manages_nothing():
    assert decide("cpus:1", None, None) == GpuFlags(gpus=None, discovered=True)


def test_resources_in_both_mesos_forms_and_with_roles_are_summed():
    assert parse_gpus("cpus:1;gpus(gpu-role):2;gpus:1") == 3
    assert parse_gpus('[{"name": "gpus", "type": "SCALAR", "scalar": {"value": 2}}]') == 2
    assert parse_gpus("cpus:1;mem:128") is None
    assert parse_gpus("") is None


def test_nvml_is_not_needed_for_the_opt_out_or_without_isolation():
    assert not wants_nvml("gpus:0", None)
    assert not wants_nvml("gpus:1", (0,), isolation=False)
    assert wants_nvml("cpus:1", None)
    assert wants_nvml("gpus:0", (0,))  # needs no NVML either, but decide() must refuse it


# Boundaries and each branch of the parser, so that a changed comparison or operator is noticed
# (make mutation, docs/mutation.md).


def test_asking_for_exactly_every_gpu_of_the_machine_is_granted():
    every = tuple(range(COUNT))
    assert decide(f"gpus:{COUNT}", every, COUNT) == GpuFlags(gpus=COUNT, indices=every)


def test_one_gpu_more_than_the_machine_has_is_refused():
    n = COUNT + 1
    with pytest.raises(
        ConfigError, match=r"^The number of GPUs requested is greater than the number of GPUs available"
    ):
        decide(f"gpus:{n}", tuple(range(n)), COUNT)


def test_device_index_equal_to_the_gpu_count_is_refused_and_the_last_index_granted():
    with pytest.raises(
        ConfigError, match=rf"^'--nvidia-gpu-devices' names GPU {COUNT}, but NVML reports GPUs 0-{COUNT - 1} only$"
    ):
        decide("gpus:1", (COUNT,), COUNT)
    assert decide("gpus:1", (COUNT - 1,), COUNT) == GpuFlags(gpus=1, indices=(COUNT - 1,))


def test_the_lowest_missing_device_index_is_named():
    with pytest.raises(ConfigError, match=r"names GPU 5,"):
        decide("gpus:2", (6, 5), COUNT)


def test_requested_gpus_without_nvml_and_no_reason_say_only_that():
    with pytest.raises(ConfigError, match=r"^gpus requested but NVML not found$"):
        decide("gpus:1", (0,), None)


@pytest.mark.parametrize("value", ["0.5", "-1"])
def test_non_integer_gpus_message_is_mesos_wording(value):
    with pytest.raises(ConfigError, match=r"^The 'gpus' resource must be a non-negative integer$"):
        decide(f"gpus:{value}", (0,), COUNT)


def test_json_resources_sum_only_gpus_entries_and_every_one_of_them():
    text = (
        '[{"name": "cpus", "type": "SCALAR", "scalar": {"value": 8}},'
        ' {"name": "gpus", "type": "SCALAR", "scalar": {"value": 1}},'
        ' {"name": "gpus", "role": "ml", "type": "SCALAR", "scalar": {"value": 2}}]'
    )
    assert parse_gpus(text) == 3


def test_json_resources_without_gpus_have_none():
    assert parse_gpus('[{"name": "cpus", "type": "SCALAR", "scalar": {"value": 8}}]') is None
    assert parse_gpus("[]") is None


@pytest.mark.parametrize("scalar", ['{"value": true}', '{"value": "2"}', "{}", "null"])
def test_json_gpus_that_are_not_a_number_are_refused(scalar):
    text = f'[{{"name": "gpus", "type": "SCALAR", "scalar": {scalar}}}]'
    with pytest.raises(ConfigError, match=r"^The 'gpus' resource must be a scalar$"):
        parse_gpus(text)


def test_unparsable_json_resources_are_refused_with_the_parser_reason():
    with pytest.raises(ConfigError, match=r"^invalid --resources JSON: Expecting"):
        parse_gpus('[{"name": "gpus",')


def test_text_entries_without_a_colon_are_skipped_not_the_end_of_the_list():
    assert parse_gpus("cpus;gpus:2") == 2
    assert parse_gpus(" gpus : 2 ; gpus(role(x)):1 ") == 3


def test_text_gpus_that_are_not_a_number_are_refused_naming_the_value():
    with pytest.raises(ConfigError, match=r"^The 'gpus' resource must be a scalar, got 'two'$"):
        parse_gpus("gpus: two ")
    with pytest.raises(ConfigError, match=r"got '1:2'"):
        parse_gpus("gpus:1:2")
